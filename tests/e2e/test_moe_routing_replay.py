"""Routing replay end to end, on a Qwen3-MoE checkpoint whose router logits tie to within float32 rounding (so
the engine's incremental decoding and the trainer's full forward pick different experts for many tokens):

- without replay the trainer's own routing disagrees with the rollout's (moe/routing_agreement < 1) and the
  step-0 train-vs-rollout mismatch is far above the dense bound;
- with replay (embedded engine; SGLang's wire format through the test server, at PP=2) the step-0 mismatch is at
  the dense bound, and activation recomputation replays the same experts in backward (same metrics, gradient
  norm included, as without it)."""

import pytest
import torch

from megatron_kl.rollout.servers import server_port
from megatron_kl.testing.distributed import run_ranks
from tests.e2e.runs import assert_same_metrics, short_config
from tests.e2e.test_sglang import TEST_SERVER, _hf_tensors
from tests.e2e.test_step0_gates import MISMATCH_BOUND
from tests.e2e.workers import train_worker

MODEL = [
    "model.architecture=qwen3",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.ffn_hidden_size=96",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.kv_channels=16",
    "model.vocab_size=61",
    "model.tie_word_embeddings=false",
    "model.rope_theta=1000000.0",
    "model.norm_epsilon=1e-6",
    "model.moe.num_experts=8",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=32",
]


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    """A random Qwen3-MoE checkpoint (transformers) whose router rows are one row times (1 + 1e-7 noise)."""
    from safetensors.torch import load_file, save_file

    from tests.distributed.hf_workers import make_hf_model

    source = make_hf_model("qwen3_moe", tmp_path_factory.mktemp("tied") / "qwen3_moe")
    tensors = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, weight in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = (
                weight[:1].expand_as(weight) * (1 + 1e-7 * torch.randn(weight.shape, generator=generator))
            ).contiguous()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    return source


def _step0(path, warm_cache, source, world, *overrides):
    cfg = short_config(path, warm_cache, *MODEL, f"init.hf_checkpoint={source}", "train.steps=1", *overrides)
    return next(r for r in run_ranks(train_worker, world, cfg, timeout_s=600)[0]["metrics"] if "loss/total" in r)


def test_routing_replay_closes_the_rollout_mismatch(tmp_path, warm_cache, tied_checkpoint):
    off = _step0(tmp_path / "off", warm_cache, tied_checkpoint, 1, "model.moe.routing_replay=off")
    assert off["moe/routing_agreement"] < 0.95, off["moe/routing_agreement"]
    assert off["mismatch/abs_logprob_mean"] > 100 * MISMATCH_BOUND, off["mismatch/abs_logprob_mean"]
    # the load counts cover the tokens the engine routed (every token but each sequence's last; no padding):
    # mean per expert and layer = routed tokens x top-2 / 8 experts, with 8 prompts x 4 samples
    assert off["moe/tokens_per_expert_mean"] == pytest.approx((off["batch/tokens"] - 32) * 2 / 8)

    replayed = _step0(tmp_path / "on", warm_cache, tied_checkpoint, 1, "model.moe.routing_replay=rollout")
    assert replayed["mismatch/abs_logprob_mean"] < MISMATCH_BOUND, replayed["mismatch/abs_logprob_mean"]
    assert replayed["moe/routing_agreement"] < 0.95  # the trainer's own routing still differs: replay overrides it
    # the same pass without replay, logged next to it: the off run's mismatch (same weights, same samples)
    assert replayed["moe/mismatch_without_replay"] == pytest.approx(off["mismatch/abs_logprob_mean"], rel=1e-5)
    assert "moe/mismatch_without_replay" not in off
    assert replayed["optim/grad_norm"] > 0
    recomputed = _step0(
        tmp_path / "recompute",
        warm_cache,
        tied_checkpoint,
        1,
        "model.moe.routing_replay=rollout",
        "model.recompute=full",
    )
    assert_same_metrics([replayed], [recomputed], "replay with activation recomputation vs without")


def test_routing_replay_over_sglang_wire_format_at_pp2(tmp_path, warm_cache, tied_checkpoint):
    step0 = _step0(
        tmp_path / "sglang",
        warm_cache,
        tied_checkpoint,
        2,
        "model.moe.routing_replay=rollout",
        "rollout.engine=sglang",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        "parallel.pipeline_parallel=2",
    )
    assert step0["mismatch/abs_logprob_mean"] < MISMATCH_BOUND, step0["mismatch/abs_logprob_mean"]
    assert step0["moe/routing_agreement"] < 0.95


def test_impossible_routing_from_the_server_is_retried_without_loss(tmp_path, tied_checkpoint):
    """The test server's --fault-routing-every answers every 2nd request with a routing one position short, an id
    past the experts or an expert twice in a token's top-k: each is retried, and the completions (tokens and
    routing) are those of a run without faults."""
    from megatron_kl.rollout.config import SGLangConfig
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.sglang import SGLangEngine
    from megatron_kl.rollout.sglang_protocol import RoutingShape
    from megatron_kl.rollout.sglang_sync import FromTensor
    from megatron_kl.testing.corruptions import ROUTING_CORRUPTIONS

    prompts, sampling = [[1, 5, 6], [1, 8], [3, 4, 5, 6], [2]], SamplingConfig(max_new_tokens=6)
    shape = RoutingShape(num_layers=4, router_topk=2, num_experts=8)
    runs = {}
    for faults in ([], ["--fault-routing-every", "2"]):
        config = SGLangConfig(
            server_module=TEST_SERVER,
            port=server_port(),
            extra_args=faults,
            max_concurrency=1,
            backoff_s=0.01,
            startup_timeout_s=120,
        )
        engine = SGLangEngine(
            config, FromTensor(config), str(tied_checkpoint), log_dir=tmp_path / "logs", vocab_size=61, routing=shape
        )
        try:
            engine.update_weights(_hf_tensors(tied_checkpoint), 1)
            runs[bool(faults)] = (engine.generate(prompts, sampling, seed=3), dict(engine.counters))
        finally:
            engine.shutdown()
    (clean, clean_counters), (faulty, counters) = runs[False], runs[True]
    assert clean_counters["retries"] == 0 and counters["retries"] >= len(ROUTING_CORRUPTIONS)
    for want, got in zip(clean, faulty):
        assert got.response_ids == want.response_ids
        assert torch.equal(got.routed_experts, want.routed_experts)
        assert tuple(got.routed_experts.shape) == (got.routed_positions, 4, 2)


def test_routing_replay_with_experts_split_over_ranks_equals_replicated_experts(tmp_path, warm_cache, tied_checkpoint):
    """EP=2 on 2 data-parallel ranks (each rank's routers replay its own rollouts' experts by global index; the
    engine replica holds every expert) logs what EP=1 logs - the expert-load counts too (over routed tokens, so
    EP's extra padding does not count); the padded-token count may differ.

    What replay does not fix is left out of the comparison: the reference routes itself and the trainer's own
    (unreplayed) routing is measured too, and on this checkpoint their near-tied routes flip with EP's other
    token layout, differently on different CPUs (kl/*, moe/routing_agreement, moe/mismatch_without_replay:
    several per cent apart on a 2-core AMD EPYC, within 1e-3 on an Intel Xeon). kl.coef=0 keeps the reference
    out of the gradient, so the update is replay's alone."""
    layout_dependent = ("kl/", "moe/routing_agreement", "moe/mismatch_without_replay")
    runs = []
    for ep in (1, 2):
        step0 = _step0(
            tmp_path / f"ep{ep}",
            warm_cache,
            tied_checkpoint,
            2,
            "model.moe.routing_replay=rollout",
            f"parallel.expert_parallel={ep}",
            "kl.coef=0",
        )
        step0.pop("batch/padded_tokens")
        assert all(step0[key] is not None for key in step0 if key.startswith(layout_dependent))
        assert step0["kl/exact_token"] > 0 and 0 < step0["moe/routing_agreement"] < 1
        runs.append({key: value for key, value in step0.items() if not key.startswith(layout_dependent)})
    assert runs[0]["mismatch/abs_logprob_mean"] < MISMATCH_BOUND
    assert_same_metrics(runs[:1], runs[1:], "routing replay at EP=2 vs EP=1")
