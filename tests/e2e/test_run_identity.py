"""A run never reports another run's results: a resume with a configuration that changes what the run computes
is refused before anything in the output directory changes; a finished run says so; a fresh start moves an
earlier run aside; one trainer writes a directory at a time."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from megatron_kl.run.run_dir import RunLock, RunRefused
from megatron_kl.train.config import load_train_config
from megatron_kl.train.metrics import read_metrics
from tests.e2e.runs import DEFAULT, Run

COMMON = [
    "checkpoint.interval=1",
    "train.prompts_per_step=4",
    "train.group_size=4",
    "task.eval_size=8",
    "eval.k=2",
    "eval.interval=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]


def _args(run: Path, cache: str, *overrides: str) -> list[str]:
    return [f"train.output_dir={run}", f"warm_start.cache_dir={cache}", *COMMON, *overrides]


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, warm_cache):
    root = tmp_path_factory.mktemp("identity")
    cache = warm_cache
    code, output = Run(root / "base.log", "--config", str(DEFAULT), *_args(root / "run", cache, "train.steps=2")).wait()
    assert code == 0, output[-3000:]
    return root / "run", cache


@pytest.mark.parametrize(
    "overrides, fields",
    [
        (["kl.estimator=k3", "kl.placement=loss"], ["kl.estimator: 'full' -> 'k3'"]),
        (["kl.coef=0.05"], ["kl.coef"]),
        (["model.ffn_hidden_size=96"], ["model.ffn_hidden_size"]),
        (["train.seed=7"], ["train.seed"]),
        (["task.seed=3"], ["task.seed"]),
        (["optim.lr=0.001"], ["optim.lr"]),
        (["train.steps=1"], ["train.steps=1 is below"]),
    ],
)
def test_a_changed_run_is_refused_naming_the_fields_and_nothing_changes(finished_run, overrides, fields):
    """In-process: the refusal comes before any process group, model or file."""
    from megatron_kl.train.loop import train

    run, cache = finished_run
    before = snapshot(run)
    with pytest.raises(RunRefused) as refused:
        train(load_train_config(str(DEFAULT), _args(run, cache, "train.steps=2", *overrides)))
    message = str(refused.value)
    assert all(field in message for field in fields), message
    assert "checkpoint.resume=false" in message and "another train.output_dir" in message
    assert snapshot(run) == before


def test_a_changed_tensor_parallel_layout_is_refused(finished_run, monkeypatch):
    from megatron_kl.train.loop import train

    run, cache = finished_run
    before = snapshot(run)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunRefused, match=r"parallel.tensor_parallel: 1 -> 2.*world_size: 1 -> 2"):
        train(load_train_config(str(DEFAULT), _args(run, cache, "train.steps=2", "parallel.tensor_parallel=2")))
    assert snapshot(run) == before


def test_the_cli_refuses_with_exit_code_2_and_a_finished_run_says_so(finished_run, tmp_path):
    run, cache = finished_run
    before = snapshot(run)
    code, output = Run(
        tmp_path / "changed.log",
        "--config",
        str(DEFAULT),
        *_args(run, cache, "train.steps=2", "kl.estimator=k3", "kl.placement=loss"),
    ).wait()
    assert code == 2 and "refused" in output and "kl.estimator: 'full' -> 'k3'" in output, output[-2000:]
    code, output = Run(tmp_path / "again.log", "--config", str(DEFAULT), *_args(run, cache, "train.steps=2")).wait()
    assert code == 0 and "already finished at step 2" in output, output[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert f"eval/id/pass@1={summary['eval_after']['eval/id/pass@1']:.3f}" in output
    assert "done:" not in output
    assert snapshot(run) == before


def test_resumable_changes_continue_and_are_recorded(finished_run, tmp_path):
    """More steps, another eval/logging/checkpoint schedule: the run continues from its checkpoint, config.yaml
    keeps the first start's record and starts.jsonl says what changed."""
    import shutil

    base, cache = finished_run
    run = tmp_path / "run"
    shutil.copytree(base, run)
    config_before = (run / "config.yaml").read_text()
    code, output = Run(
        tmp_path / "more.log",
        "--config",
        str(DEFAULT),
        *_args(run, cache, "train.steps=3", "eval.interval=2", "checkpoint.keep=1"),
    ).wait()
    assert code == 0, output[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at RL step 2" in output
    assert (run / "config.yaml").read_text() == config_before
    starts = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines()]
    assert [s["kind"] for s in starts] == ["fresh", "resume"] and starts[1]["from_step"] == 2
    assert starts[1]["changed"]["train.steps"] == [2, 3] and starts[1]["changed"]["eval.interval"] == [0, 2]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss/total" in r] == [0, 1, 2]


def test_a_fresh_start_moves_the_old_run_aside_and_owns_the_directory(finished_run, tmp_path):
    """checkpoint.resume=false on a used directory: the old files move into superseded-<time>/ untouched; the
    new run's checkpoints are the only ones, and the next normal start resumes the new run, not the old one."""
    import shutil

    base, cache = finished_run
    run = tmp_path / "run"
    shutil.copytree(base, run)
    old = snapshot(run)
    code, output = Run(
        tmp_path / "fresh.log",
        "--config",
        str(DEFAULT),
        *_args(run, cache, "train.steps=1", "kl.coef=0.05", "checkpoint.resume=false"),
    ).wait()
    assert code == 0, output[-3000:]
    aside = [p for p in run.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and f"moved them to {aside[0]}" in output
    assert {k: v for k, v in snapshot(aside[0]).items() if k != ".lock"} == {
        k: v for k, v in old.items() if k != ".lock"
    }
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss/total" in r] == [0]
    code, output = Run(
        tmp_path / "next.log", "--config", str(DEFAULT), *_args(run, cache, "train.steps=2", "kl.coef=0.05")
    ).wait()
    assert code == 0 and f"resumed from {run / 'checkpoints' / 'step_000001'} at RL step 1" in output, output[-3000:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss/total" in r] == [0, 1]


def test_a_second_trainer_on_a_locked_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    lock = RunLock(run)
    try:
        code, output = Run(
            tmp_path / "second.log",
            "--config",
            str(DEFAULT),
            *_args(run, str(tmp_path / "cache"), "train.steps=1", "warm_start.enabled=false"),
        ).wait()
        assert code == 2 and f"in use by pid {os.getpid()}" in output, output[-2000:]
        assert sorted(p.name for p in run.iterdir()) == [".lock"]
        with pytest.raises(RunRefused, match="in use by pid"):
            RunLock(run)  # a second open file description of the same process is refused too
    finally:
        lock.release()
    RunLock(run).release()  # free again once released (and the kernel frees it when a holder dies)
