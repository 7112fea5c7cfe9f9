"""DeepSeek-V3 (multi-latent attention with a query LoRA, YaRN, a dense first layer, a shared expert, the sigmoid
router with its score-correction bias, group-limited top-k) and GPT-OSS (attention sinks, sliding and full layers,
biases, YaRN, the clamped GLU, fused experts) train from HF checkpoints written by transformers:

- step 0 with policy = reference gives the exact KL 0 and the rollout's log-probs to float32 rounding, at every
  layout below; the expert-load metrics are logged;
- its experts split over two expert-parallel ranks and its layers over two pipeline stages (rollouts from the SGLang
  test server) each log what the one-rank layout logs, step for step, once the policy has moved (an entropy bonus
  moves it from step 0); tensor parallelism in training needs sequence parallelism (GPUs), refused without it;
- routing replay replays the rollout's experts into the policy's routers (the dense layer has none); the replayed
  and the unreplayed pass agree on these checkpoints, which have no near-tied routers."""

import json

import pytest

from megatron_kl.rollout.servers import server_port
from megatron_kl.testing.distributed import run_ranks
from tests.e2e.runs import assert_same_metrics, short_config
from tests.e2e.test_sglang import TEST_SERVER
from tests.e2e.test_step0_gates import KL_BOUND, MISMATCH_BOUND
from tests.e2e.workers import train_worker

STRUCTURE = {  # the fields the default config sets otherwise; the rest come from config.json
    "deepseek_v3": [
        "model.architecture=deepseek_v3",
        "model.num_layers=4",
        "model.hidden_size=64",
        "model.ffn_hidden_size=96",
        "model.num_attention_heads=4",
        "model.num_query_groups=4",
        "model.vocab_size=61",
        "model.tie_word_embeddings=false",
        "model.norm_epsilon=1e-6",
    ],
    "gpt_oss": [
        "model.architecture=gpt_oss",
        "model.num_layers=4",
        "model.hidden_size=64",
        "model.ffn_hidden_size=32",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.kv_channels=16",
        "model.vocab_size=61",
        "model.tie_word_embeddings=false",
        "model.norm_epsilon=1e-5",
    ],
}
FAMILIES = list(STRUCTURE)
MOVING = ["algo.entropy_coef=0.05", "train.steps=2", "train.prompts_per_step=4", "task.eval_size=2", "eval.k=1"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.distributed.hf_workers import make_hf_model

    root = tmp_path_factory.mktemp("families")
    dense = _all_dense(root / "dense")
    assert json.loads((dense / "config.json").read_text())["first_k_dense_replace"] == 4
    return {
        "deepseek_v3": make_hf_model("deepseek_v3", root / "deepseek_v3", seed=3),
        "gpt_oss": make_hf_model("gpt_oss", root / "gpt_oss", seed=5),
        "deepseek_v3_dense": dense,
    }


def _all_dense(directory):
    """A DeepSeek-V3 with every layer's MLP dense (first_k_dense_replace = the layers), written by transformers."""
    from tests.distributed.hf_workers import MOE_FAMILIES, make_hf_model

    spec = {**MOE_FAMILIES["deepseek_v3"], "first_k_dense_replace": 4}
    MOE_FAMILIES["deepseek_v3_dense"] = spec
    try:
        return make_hf_model("deepseek_v3_dense", directory, seed=4)
    finally:
        MOE_FAMILIES.pop("deepseek_v3_dense")


def _run(path, warm_cache, family, source, world, *overrides):
    cfg = short_config(path, warm_cache, *STRUCTURE[family], f"init.hf_checkpoint={source}", *MOVING, *overrides)
    return [r for r in run_ranks(train_worker, world, cfg, timeout_s=600)[0]["metrics"] if "loss/total" in r]


def _check_step0(records, what):
    step0 = records[0]
    assert abs(step0["kl/exact_token"]) < KL_BOUND and abs(step0["kl/exact_sequence"]) < KL_BOUND, what
    assert step0["mismatch/abs_logprob_mean"] < MISMATCH_BOUND, (what, step0["mismatch/abs_logprob_mean"])
    assert records[1]["kl/exact_token"] > 1e-6, f"{what}: the policy did not move"
    assert all(r["optim/grad_norm"] > 0 for r in records), what


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_run_logs_what_one_rank_logs(tmp_path, warm_cache, checkpoints, family):
    """With routing replay: the policy's routers replay the rollout's experts (the dense layers have no router)."""
    runs = {
        ep: _run(
            tmp_path / f"ep{ep}",
            warm_cache,
            family,
            checkpoints[family],
            2,
            f"parallel.expert_parallel={ep}",
            "model.moe.routing_replay=rollout",
        )
        for ep in (1, 2)
    }
    for ep, records in runs.items():
        _check_step0(records, f"EP={ep}")
        assert records[0]["moe/routing_agreement"] == 1.0 and records[0]["moe/load_imbalance"] >= 1.0
        assert records[0]["moe/mismatch_without_replay"] < MISMATCH_BOUND  # a checkpoint without near-ties
    # EP pads each rank's batch to the ranks' longest sequence, which the routers' counts include
    layout = ("batch/padded_tokens", "moe/tokens_per_expert", "moe/load_imbalance", "moe/mismatch_without_replay")
    strip = {
        ep: [{k: v for k, v in r.items() if not k.startswith(layout)} for r in records] for ep, records in runs.items()
    }
    assert_same_metrics(strip[1], strip[2], f"{family} EP=2 vs EP=1")


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_parallel_run_logs_what_one_stage_logs(tmp_path, warm_cache, checkpoints, family):
    """Rollouts from the SGLang test server with their routing (replayed), each stage replaying its layers'."""
    sglang = ["rollout.engine=sglang", f"rollout.sglang.server_module={TEST_SERVER}"]
    runs = {
        pp: _run(
            tmp_path / f"pp{pp}",
            warm_cache,
            family,
            checkpoints[family],
            pp,
            f"parallel.pipeline_parallel={pp}",
            *sglang,
            f"rollout.sglang.port={server_port()}",
            "model.moe.routing_replay=rollout",
        )
        for pp in (1, 2)
    }
    for pp, records in runs.items():
        _check_step0(records, f"{family} PP={pp}")
        assert records[0]["moe/routing_agreement"] == 1.0  # SGLang's wire format; DeepSeek's dense layer skipped
    assert_same_metrics(runs[1], runs[2], f"{family} PP=2 vs PP=1")


def test_tensor_parallel_training_without_sequence_parallel_is_refused(tmp_path, warm_cache, checkpoints):
    """Megatron-core's MLA reduces the shared rotary key's gradient over the TP ranks only with sequence parallelism
    (measured here: the latent query norm's gradient 2x and the key projection's ~1 % off at TP 2), so a dense
    DeepSeek-V3 at TP 2 without it is refused before anything starts; its TP 2 forward is exact
    (tests/distributed/test_moe_conversion.py)."""
    cfg = short_config(
        tmp_path / "tp2",
        warm_cache,
        *STRUCTURE["deepseek_v3"],
        f"init.hf_checkpoint={checkpoints['deepseek_v3_dense']}",
        *MOVING,
        "parallel.tensor_parallel=2",
    )
    with pytest.raises(Exception, match="parallel.sequence_parallel=true"):
        run_ranks(train_worker, 2, cfg, timeout_s=300)
    assert not (tmp_path / "tp2" / "metrics.jsonl").exists()
