"""Step-0 gates (as slime's CI checks its step-0 KL): before the first update the policy IS the reference and the
rollout engine holds the same weights, so at step 0 the exact KL between policy and reference must be ~0 and the
rollout's log-probs must equal the trainer's. A wrong weight load, a wrong shard or a wrong weight sync breaks
one of them while every loss curve would still look plausible.

Bounds (float32): exact KL per token < 1e-8; mean |train - rollout| log-prob < 1e-4 (the engines compute the
same math with other kernels: decode attention, batch shapes). The same gate for vLLM runs in CI's second stage
(tests/e2e/test_vllm.py::test_training_on_vllm_rollouts); for a run from init.hf_checkpoint in
tests/e2e/test_train.py::test_train_starts_from_hf_checkpoint_and_exports_hf."""

import pytest

from megatron_kl.rollout.servers import server_port
from megatron_kl.testing.distributed import run_ranks
from tests.e2e.runs import short_config
from tests.e2e.test_sglang import TEST_SERVER
from tests.e2e.workers import train_worker

KL_BOUND, MISMATCH_BOUND = 1e-8, 1e-4

CASES = [
    ("embedded-tp1", 1, []),
    ("embedded-tp2", 2, ["parallel.tensor_parallel=2"]),
    ("sglang-test-server-tp1", 1, ["rollout.engine=sglang", f"rollout.sglang.server_module={TEST_SERVER}"]),
    (
        "sglang-test-server-pp2",
        2,
        ["rollout.engine=sglang", f"rollout.sglang.server_module={TEST_SERVER}", "parallel.pipeline_parallel=2"],
    ),  # the embedded engine has no PP
]


@pytest.mark.parametrize("name, world, overrides", CASES, ids=[c[0] for c in CASES])
def test_step_0_policy_equals_reference_and_rollout(tmp_path, warm_cache, name, world, overrides):
    extra = [f"rollout.sglang.port={server_port()}"] if "rollout.engine=sglang" in overrides else []
    cfg = short_config(
        tmp_path / "run", warm_cache, "train.steps=1", "kl.estimator=k3", "kl.placement=loss", *overrides, *extra
    )
    out = run_ranks(train_worker, world, cfg, timeout_s=600)
    step0 = next(r for r in out[0]["metrics"] if "loss/total" in r and r["step"] == 0)
    assert 0 <= step0["kl/exact_token"] < KL_BOUND, step0["kl/exact_token"]
    assert step0["mismatch/abs_logprob_mean"] < MISMATCH_BOUND, step0["mismatch/abs_logprob_mean"]
