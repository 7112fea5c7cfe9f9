"""Test tiers.

* fast (``-m "fast and not gpu"``, about 5 minutes on 2 cores; run before every commit): every unit test, and from
  the end-to-end and sharded suites one small representative per subject - sharded gloo results against one
  rank, resume/identity refusals, checkpoint damage, signals, step-0 gates, engines.
* full (``-m "not gpu and not slow"``, the CI command in README.md): everything.

The fast tier is declared here by node-id prefix, so a test's tier is visible in one place.
"""

import importlib.util
import os

import pytest
import torch

# Triton decides between compiled and interpreted functions when triton.language is first imported (the test ranks'
# fork server imports it with torch), so on a machine without CUDA the interpreter is chosen for the whole session,
# before any rank starts; it changes nothing unless MEGATRON_KL_TRITON=1 asks for the Triton kernels on CPU tensors.
# Not in the vLLM environment (CI's second stage runs only the vLLM tests, and vLLM's own kernels are its business).
if not torch.cuda.is_available() and importlib.util.find_spec("vllm") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAST = (
    "tests/unit/",
    "megatron_kl/validation/test_vocab_parallel.py::test_matches_unsharded_float64_reference[2]",
    "tests/distributed/test_truncation.py::test_sharded_support_and_truncated_statistics_match_the_direct_rule[2]",
    "tests/distributed/test_top_p_histogram.py::test_histogram_cut_equals_the_rule_over_shards[narrowing-2]",
    "tests/distributed/test_top_p_histogram.py::test_without_a_compiler",
    "tests/distributed/test_triton_kernels.py::test_the_cpu_kernels_float64_suites_pass_on_the_triton_path[fused_and_unfused_statistics-2]",
    "tests/distributed/test_triton_kernels.py::test_edges_match_the_closed_form[2]",
    "tests/distributed/test_triton_kernels.py::test_dispatch_follows_the_device_and_the_switch",
    "tests/distributed/test_triton_kernels.py::test_every_launch_compiles_for_hopper_and_passes_no_float_scalar",
    "tests/distributed/test_context_parallel_loss.py",
    "tests/distributed/test_context_parallel_model_path.py::test_shards_are_megatrons_and_the_loss_equals_one_rank[2]",
    "megatron_kl/validation/test_model_layouts.py::test_layout_matches_single_rank[tp2]",
    "megatron_kl/validation/test_model_layouts.py::test_layout_matches_single_rank[pp2-1f1b]",
    "tests/distributed/test_hf_conversion.py::test_config_derivation",
    "tests/distributed/test_moe_conversion.py::test_moe_logits_match_hf_and_export_is_bit_exact[deepseek_v3-tp2]",
    "tests/distributed/test_nonfinite_updates.py",
    "tests/distributed/test_routing_replay.py::test_replayed_policy_reproduces_the_engine_and_the_reference_routes_itself",
    "tests/e2e/test_engine.py::test_engine_sharing_the_policy_weights_generates_what_a_copy_generates",
    "tests/e2e/test_run_identity.py::test_a_changed_run_is_refused_naming_the_fields_and_nothing_changes",
    "tests/e2e/test_run_identity.py::test_a_second_trainer_on_a_locked_directory_is_refused",
    "tests/e2e/test_checkpoint_integrity.py::test_a_damaged_checkpoint_is_named_and_the_previous_one_used[flip_64_bits]",
    "tests/e2e/test_signals.py::test_ctrl_c_and_hangup_checkpoint_the_finished_steps[SIGINT]",
    "tests/e2e/test_step0_gates.py::test_step_0_policy_equals_reference_and_rollout[embedded-tp2]",
    "tests/e2e/test_train.py::test_bad_config_values_fail_with_the_field_named",
    "tests/e2e/test_trainer.py",
    "tests/e2e/test_extensions.py",
    "tests/e2e/test_family_training.py::test_expert_parallel_run_logs_what_one_rank_logs",
    "tests/e2e/test_train.py::test_a_bad_config_value_exits_2_before_anything_starts",
    "tests/e2e/test_partial_rollouts.py::test_a_paused_generation_resumes_with_the_new_weights_token_for_token[1]",
    "tests/e2e/test_fp8_rollouts.py::test_the_engine_samples_the_fp8_policy_and_the_trainer_keeps_its_weights[1]",
    "tests/e2e/test_delta_sync.py::test_the_embedded_engine_copies_only_changed_elements_and_repairs_a_drifted_replica[1]",
)
# unit tests left to the full tier: the same check on more shapes (one representative stays fast)
FULL_ONLY = (
    "tests/unit/test_kl_dynamics.py::test_unbiased_configurations_reach_the_optimum_and_biased_ones_do_not[off-policy-",
    "tests/unit/test_kl_dynamics.py::test_unbiased_configurations_reach_the_optimum_and_biased_ones_do_not[on-policy-V2",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(FAST) and not item.nodeid.startswith(FULL_ONLY):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """One warm-start cache for the whole session: the cache is keyed by the model, task and warm-start settings,
    so every run that shares them reuses one supervised phase (~40 s on 2 cores) instead of repeating it."""
    return str(tmp_path_factory.mktemp("warm_start_cache"))
