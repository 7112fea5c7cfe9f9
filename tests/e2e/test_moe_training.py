"""A mixture-of-experts policy trains end to end on the CPU job: the same RL run with its experts split over two
expert-parallel ranks logs the metrics of the run that keeps every expert on each rank (same data-parallel
split), every metric finite, the expert-load metrics logged; a layout the MoE layer cannot train is refused
before anything starts."""

import pytest

from megatron_kl.testing.distributed import run_ranks
from tests.e2e.runs import assert_same_metrics, short_config
from tests.e2e.workers import train_worker

MOE = [
    "model.moe.num_experts=4",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=64",
    "warm_start.steps=60",
    "train.steps=2",
    "train.prompts_per_step=4",
]


def test_expert_parallel_training_matches_replicated_experts(tmp_path, warm_cache):
    runs = {}
    for ep in (1, 2):
        cfg = short_config(tmp_path / f"ep{ep}", warm_cache, *MOE, f"parallel.expert_parallel={ep}")
        runs[ep] = [r for r in run_ranks(train_worker, 2, cfg, timeout_s=600)[0]["metrics"] if "loss/total" in r]
    assert [r["step"] for r in runs[1]] == [0, 1]
    # EP=2 pads each rank's batch to the ranks' longest sequence (the token dispatch's all-gather): the padded-token
    # count and the routers' counts (which include padding positions) may differ, nothing else
    for key in (
        "batch/padded_tokens",
        "moe/tokens_per_expert_max",
        "moe/tokens_per_expert_min",
        "moe/tokens_per_expert_mean",
        "moe/load_imbalance",
    ):
        assert all(b[key] >= a[key] for a, b in zip(runs[1], runs[2])) or key.startswith("moe/"), key
        for record in runs[1] + runs[2]:
            record[key + "@layout"] = record.pop(key)
    for record in runs[2]:
        assert record["moe/load_imbalance@layout"] >= 1.0 and record["moe/tokens_per_expert_mean@layout"] > 0
    strip = [{k: v for k, v in r.items() if not k.endswith("@layout")} for r in runs[1] + runs[2]]
    assert_same_metrics(strip[:2], strip[2:], "EP=2 vs EP=1 (2 data-parallel ranks)")
    assert all(r["optim/grad_norm"] > 0 for r in strip)
    # EP=2 stopped after step 0 (its checkpoint holds each rank's experts) and resumed: step 1 as uninterrupted
    stopped = tmp_path / "ep2-stopped"
    run_ranks(
        train_worker,
        2,
        short_config(stopped, warm_cache, *MOE, "parallel.expert_parallel=2", "train.steps=1"),
        timeout_s=600,
    )
    resumed = run_ranks(
        train_worker, 2, short_config(stopped, warm_cache, *MOE, "parallel.expert_parallel=2"), timeout_s=600
    )[0]["metrics"]
    resumed = [
        {k: v for k, v in r.items() if not k.startswith("moe/") and k != "batch/padded_tokens"}
        for r in resumed
        if "loss/total" in r
    ]
    assert [r["step"] for r in resumed] == [0, 1]
    uninterrupted = [{k: v for k, v in r.items() if not k.startswith("moe/")} for r in strip[3:]]
    assert_same_metrics(resumed[1:], uninterrupted, "EP=2 resumed at step 1 vs uninterrupted")


def test_tensor_parallel_moe_training_without_sequence_parallel_is_refused(tmp_path, warm_cache):
    from megatron_kl.config import ConfigError

    cfg = short_config(tmp_path / "tp2", warm_cache, *MOE, "parallel.tensor_parallel=2")
    with pytest.raises(Exception, match="parallel.sequence_parallel=true"):
        run_ranks(train_worker, 2, cfg, timeout_s=300)
    assert not (tmp_path / "tp2" / "metrics.jsonl").exists()
    assert ConfigError  # the error type the ranks raised (re-raised here as RankFailure with its message)
