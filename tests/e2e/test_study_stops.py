"""A study stopped in every way an operator or a scheduler stops it (kill -9, SIGTERM, Ctrl-C's SIGINT, Slurm's time
limit: SIGTERM to every process, SIGKILL after the grace period) leaves no trainer behind, and the same command run
again at once finishes it: every step of every run logged exactly once, no run counted as failed, a status and a
report as an uninterrupted study's. Two studies on one output directory are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from megatron_kl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _study(tmp_path: Path, warm_cache: str) -> Path:
    common = [
        f"warm_start.cache_dir={warm_cache}",
        f"train.steps={STEPS}",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=0",
        "checkpoint.interval=1",
        "logging.tensorboard=false",
    ]
    data = {
        "name": "stops",
        "base": str(ROOT / "configs" / "cpu" / "default.yaml"),
        "output_dir": str(tmp_path / "out"),
        "seeds": [1],
        "common": common,
        "configurations": [
            {"name": "k3-loss", "overrides": ["kl.estimator=k3", "kl.placement=loss"]},
            {"name": "k1-reward", "overrides": ["kl.estimator=k1", "kl.placement=reward"]},
        ],
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start(path: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "megatron_kl.cli", "study", "--config", str(path)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _trainers(study: psutil.Process) -> list[psutil.Process]:
    out = []
    for p in study.children(recursive=True):
        try:
            if "train" in p.cmdline():
                out.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # a trainer that has just ended
            continue
    return out


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path) if "reward/mean" in r] if path.is_file() else []


def _gone(processes: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


@pytest.mark.parametrize("how", ["kill-9", "SIGTERM", "SIGINT", "time-limit"])
def test_a_stopped_study_leaves_no_trainer_and_the_same_command_finishes_it(tmp_path, warm_cache, how):
    path = _study(tmp_path, warm_cache)
    out = tmp_path / "out"
    first_run = out / "runs" / "k3-loss-seed1"
    proc = _start(path, tmp_path / "first.log")
    study = psutil.Process(proc.pid)
    deadline = time.monotonic() + 600
    while len(_steps(first_run)) < 2:  # the first run is training, a checkpoint behind it
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.1)
    trainers = _trainers(study)
    assert trainers, "no trainer under the study"
    if how == "kill-9":
        proc.kill()
    elif how == "time-limit":  # Slurm: SIGTERM to every process of the step, SIGKILL to all after KillWait
        for p in [study, *trainers]:
            p.send_signal(signal.SIGTERM)
        time.sleep(2)
        for p in [study, *trainers]:
            if p.is_running():
                p.kill()
    else:
        proc.send_signal(getattr(signal, how))
    code = proc.wait(timeout=300)
    assert _gone(trainers, 120), f"{how}: a trainer outlived its study: {[p.pid for p in trainers if p.is_running()]}"
    output = (tmp_path / "first.log").read_text()
    if how in ("SIGTERM", "SIGINT"):
        assert code == (130 if how == "SIGINT" else 75), output[-3000:]
        assert f"stopped by {how}" in output and "run the same command again" in output, output[-2000:]
        status = json.loads((out / "status.json").read_text())
        assert status["k3-loss-seed1"]["state"] == "interrupted", status
    # again at once: it finishes, nothing failed, every step of every run logged once
    again = subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "study", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert {name: entry["state"] for name, entry in status.items()} == {"k3-loss-seed1": "ok", "k1-reward-seed1": "ok"}
    for run in ("k3-loss-seed1", "k1-reward-seed1"):
        assert _steps(out / "runs" / run) == list(range(STEPS)), run
    resumed = (out / "logs" / "k3-loss-seed1.log").read_text()
    assert "resumed from" in resumed and "\x00" not in resumed
    results = json.loads((out / "results.json").read_text())
    assert all(row["failed"] == [] and row["not_run"] == [] for row in results.values()), results


def test_two_studies_on_one_output_directory_are_refused_and_report_only_names_runs_not_run(tmp_path, warm_cache):
    path = _study(tmp_path, warm_cache)
    out = tmp_path / "out"
    proc = _start(path, tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 600
        while not (out / ".lock").is_file() or not _trainers(psutil.Process(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "megatron_kl.cli", "study", "--config", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 2 and f"{out} is in use by pid {proc.pid}" in second.stderr, second.stderr[-2000:]
        assert "one study runs in a study's output_dir at a time" in second.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    report = subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "study", "--config", str(path), "--report-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 1, report.stderr[-2000:]
    assert "0 run(s) failed" in report.stderr and "2 not run (or interrupted)" in report.stderr, report.stderr[-2000:]
    text = (out / "report.md").read_text()
    assert "2 of 2 runs have not run or were interrupted" in text
    results = json.loads((out / "results.json").read_text())
    assert results["k3-loss"]["failed"] == [] and results["k3-loss"]["not_run"] == ["k3-loss-seed1"]
    assert results["k1-reward"]["seeds_ok"] == 0 and results["k1-reward"]["not_run"] == ["k1-reward-seed1"]
    claims = json.loads((out / "claims.json").read_text())
    assert all(stat["seeds"] == 0 for claim in claims for stat in claim["statistics"].values()), claims
