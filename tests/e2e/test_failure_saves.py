"""Trained steps are never dropped: an error that ends a run after its first trained step - an engine error,
the NaN/inf abort, anything unexpected - first writes the checkpoint of the finished steps where the state is
theirs, and the final message says which step was saved (or exactly why none could be); the run then resumes
from it. A step that already applied an update is not saved as a finished one."""

import pytest

from megatron_kl.testing.distributed import run_ranks
from tests.e2e.runs import short_config
from tests.e2e.workers import failing_train_worker, train_worker


@pytest.mark.parametrize("kind, world", [("unexpected", 1), ("nonfinite", 1), ("nonfinite", 2)])
def test_an_error_after_trained_steps_saves_them_first_and_the_run_resumes(tmp_path, warm_cache, kind, world):
    cfg = short_config(
        tmp_path / "run",
        warm_cache,
        "train.steps=4",
        "checkpoint.interval=0",
        *(["train.prompts_per_step=8"] if world == 2 else []),
    )
    out = run_ranks(failing_train_worker, world, cfg, 2, kind, timeout_s=600)
    for rank_out in out:
        got = rank_out
        assert got["error"] is not None and got["step"] == 2, got
        assert got["checkpoints"] == ["step_000002"], got
        assert "the 2 finished steps are saved in" in got["error"] and "step_000002" in got["error"], got["error"]
        assert got["cause"] == ("NonFiniteUpdates" if kind == "nonfinite" else "RuntimeError")
    if kind == "unexpected":  # the saved steps resume (one case: the resume path is the same for every kind)
        resumed = run_ranks(train_worker, world, cfg, timeout_s=600)[0]
        steps = [r["step"] for r in resumed["metrics"] if "loss/total" in r]
        assert steps == [0, 1, 2, 3], steps  # steps 0, 1 from the first run, 2, 3 after the resume


def test_a_step_that_applied_an_update_is_not_saved_as_finished(tmp_path, warm_cache):
    cfg = short_config(tmp_path / "run", warm_cache, "train.steps=5", "checkpoint.interval=2")
    got = run_ranks(failing_train_worker, 1, cfg, 3, "after_update", timeout_s=600)[0]
    assert got["checkpoints"] == ["step_000002"], got  # the interval's, nothing for the 3 finished steps
    assert "no checkpoint written (step 4 had already applied 1 optimizer update(s))" in got["error"], got["error"]
    assert "the newest checkpoint is" in got["error"] and "step_000002" in got["error"], got["error"]


def test_an_error_before_any_step_says_nothing_was_trained(tmp_path, warm_cache):
    cfg = short_config(tmp_path / "run", warm_cache, "train.steps=2")
    got = run_ranks(failing_train_worker, 1, cfg, 0, "unexpected", timeout_s=600)[0]
    assert got["checkpoints"] == [] and "no step finished" in got["error"], got


def test_a_malformed_engine_answer_mid_run_exits_1_naming_the_saved_checkpoint(tmp_path, warm_cache):
    """The SGLang test server answers meta_info: null at its 70th /generate (steps 0 and 1 trained by then, no
    interval checkpoint): exit 1, the last line names the engine error and the checkpoint of the finished steps."""
    from megatron_kl.rollout.servers import server_port
    from tests.e2e.runs import DEFAULT, Run
    from tests.e2e.test_sglang import TEST_SERVER

    run = tmp_path / "run"
    code, output = Run(
        tmp_path / "log.txt",
        "--config",
        str(DEFAULT),
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        "train.steps=6",
        "checkpoint.interval=0",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "rollout.engine=sglang",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        "rollout.sglang.extra_args=[--fault-malformed-every,70]",
    ).wait()
    assert code == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and saved[0] in last and "rollout engine error" in last and "meta_info" in last, last
