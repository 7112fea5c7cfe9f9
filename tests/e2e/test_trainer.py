"""The Trainer object: one RL step is callable on its own (no fit(), no final evaluation, no summary) and gives
what the full run logs for that step, bit for bit (timings aside)."""

from megatron_kl.testing.distributed import run_ranks
from tests.e2e.runs import short_config, stable
from tests.e2e.workers import train_worker, trainer_steps_worker


def test_trainer_steps_alone_equal_the_runs_steps(tmp_path):
    cache = str(tmp_path / "cache")
    overrides = ("warm_start.steps=10", "train.steps=2", "eval.interval=0")
    stepped = run_ranks(
        trainer_steps_worker, 1, short_config(tmp_path / "stepped", cache, *overrides), 2, timeout_s=600
    )[0]
    assert stepped["rl_steps"] == 2
    assert not (tmp_path / "stepped" / "summary.json").exists()  # step() is not fit(): no final evaluation, no summary
    full = run_ranks(train_worker, 1, short_config(tmp_path / "full", cache, *overrides), timeout_s=600)[0]["metrics"]
    logged = [r for r in full if r["step"] < 2]
    assert len(logged) == 2
    for mine, theirs in zip(stable(stepped["records"]), stable(logged)):
        shared = set(mine) & set(theirs)
        assert len(shared) > 20 and set(mine) - {"step"} <= set(theirs)
        assert {k: mine[k] for k in shared} == {k: theirs[k] for k in shared}
