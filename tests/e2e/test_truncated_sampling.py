"""Training with top-k / top-p sampling: the trainer differentiates the distribution the engine sampled from
(rollout.sampling.distribution=truncated) at TP 1 and 2 and on the fused path, with the same metrics up to fp32
rounding; the step-0 train-vs-rollout mismatch is ~0 with it and clearly non-zero with distribution=full."""

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.metric_registry import lookup
from tests.e2e.runs import assert_same_metrics, short_config
from tests.e2e.workers import train_worker

TRUNCATED = ("rollout.sampling.top_p=0.9", "rollout.sampling.top_k=20", "rollout.sampling.temperature=0.9")


def _steps(metrics):
    return [m for m in metrics if "mismatch/abs_logprob_max" in m]


def test_truncated_policy_trains_on_policy_at_tp1_tp2_and_fused(tmp_path, warm_cache):
    tp1 = run_ranks(train_worker, 1, short_config(tmp_path / "tp1", warm_cache, *TRUNCATED), timeout_s=300)[0][
        "metrics"
    ]
    steps = _steps(tp1)
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert m["sampling/truncated_mass"] > 0.01, m  # the truncation cuts something away
        assert 1.0 <= m["sampling/support_size"] < 20.0 + 1e-9, m
        assert m["sampling/outside_support"] == 0.0, m
        assert m["kl/biased"] == 0.0
    assert steps[0]["mismatch/abs_logprob_max"] < 1e-4, steps[0]  # the same distribution on both sides
    for record in tp1:
        for key in record:
            assert lookup(key) is not None, f"{key} is logged but not in the metric registry"
    tp2 = run_ranks(
        train_worker,
        2,
        short_config(tmp_path / "tp2", warm_cache, *TRUNCATED, "parallel.tensor_parallel=2"),
        timeout_s=300,
    )[0]["metrics"]
    assert_same_metrics(tp1, tp2, "TP2 vs TP1")
    fused = run_ranks(
        train_worker,
        1,
        short_config(tmp_path / "fused", warm_cache, *TRUNCATED, "model.logprob_path=fused"),
        timeout_s=300,
    )[0]["metrics"]
    assert_same_metrics(tp1, fused, "fused vs unfused")


def test_full_distribution_under_truncation_shows_the_mismatch_and_is_tagged_biased(tmp_path, warm_cache):
    cfg = short_config(tmp_path / "full", warm_cache, *TRUNCATED, "rollout.sampling.distribution=full", "train.steps=1")
    steps = _steps(run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"])
    assert steps[0]["mismatch/abs_logprob_mean"] > 1e-2, steps[0]  # log mu - log pi = -log pi(support) > 0
    assert steps[0]["kl/biased"] == 1.0
    assert "sampling/truncated_mass" not in steps[0]


def test_pi_old_from_the_update_carries_the_support_statistics(tmp_path, warm_cache):
    """algo.old_logprobs=from_update on the fused single pass: pi_old's truncated log-probs and support
    statistics come out of the first update's forward (no scoring pass), on-policy at step 0."""
    cfg = short_config(
        tmp_path / "from_update",
        warm_cache,
        *TRUNCATED,
        "algo.old_logprobs=from_update",
        "algo.minibatches=1",
        "model.logprob_path=fused",
        "train.steps=1",
    )
    steps = _steps(run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"])
    assert steps[0]["mismatch/abs_logprob_max"] < 1e-4, steps[0]
    assert steps[0]["sampling/truncated_mass"] > 0.01 and steps[0]["sampling/outside_support"] == 0.0
