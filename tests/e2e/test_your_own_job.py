"""A lab's own job end to end, as docs/your-own-job.md shows it: the worked example (own data with its own columns,
reward functions from a file, combined with weights) through `megatron-kl train`; the Python example (a registered
reward, a Trainer stepped by hand); a verifier service in training - a failing sample excluded and counted, and a
service that breaks mid-run stopping the run naming the function and row, with the finished steps saved."""

import os
import subprocess
import sys
from pathlib import Path

from megatron_kl.testing.reward_server import RewardServer
from megatron_kl.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _train(tmp_path: Path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_kl.cli",
                "train",
                "--config",
                config,
                f"warm_start.cache_dir={tmp_path / 'cache'}",
                "logging.progress=false",
                "logging.tensorboard=false",
                *overrides,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
            timeout=600,
        )
    proc.output = log.read_text()
    return proc


def test_the_worked_example_trains_on_its_own_data_with_its_own_rewards(tmp_path):
    run = tmp_path / "run"
    proc = _train(
        tmp_path,
        "configs/examples/word-problems.yaml",
        f"train.output_dir={run}",
        "warm_start.steps=40",
        "train.steps=2",
        "eval.interval=0",
        "checkpoint.interval=0",
    )
    assert proc.returncode == 0, proc.output[-3000:]
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert (
            r["reward/mean"] == r["reward/fn/number"] + 0.2 * r["reward/fn/unit"]
            or abs(r["reward/mean"] - (r["reward/fn/number"] + 0.2 * r["reward/fn/unit"])) < 1e-6
        )
        assert 0.0 <= r["reward/extra/parsed"] <= 1.0 and r["reward/failed"] == 0.0
    assert {"eval/id/pass@1", "eval/ood/pass@1"} <= set(records[0])
    config = (run / "config.yaml").read_text()
    assert "examples/word_problems/rewards.py:number" in config and "prompt_column: story" in config


def test_the_python_example_steps_a_trainer_with_a_registered_reward(tmp_path):
    log = tmp_path / "python.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "examples/train_from_python.py", "--steps", "2", "--output-dir", str(tmp_path / "run")],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
            timeout=600,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"]
    assert lines[1].endswith("engine at version 2") and "saved " in text
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(0 <= r["reward/extra/short"] <= 1 for r in records if "reward/extra/short" in r)


SERVICE = (
    "train.steps=3",
    "train.prompts_per_step=4",
    "train.group_size=2",
    "task.eval_size=4",
    "eval.k=1",
    "eval.interval=0",
    "checkpoint.interval=1",
    "warm_start.enabled=false",
    "reward.functions=[{name: service}]",
    "reward.service.batch_size=1000",
    "reward.service.max_retries=0",
    "reward.service.backoff_s=0",
)


def test_a_sample_the_service_cannot_score_is_excluded_and_counted(tmp_path):
    run = tmp_path / "run"
    with RewardServer(faults={"nan": 1}) as server:  # every request's first reward is NaN
        proc = _train(
            tmp_path,
            "configs/cpu/default.yaml",
            f"train.output_dir={run}",
            *SERVICE,
            f"reward.service.urls=[{server.url}]",
            "reward.on_failure=exclude",
        )
    assert proc.returncode == 0, proc.output[-3000:]
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward/failed" in r]
    assert [r["reward/failed"] for r in steps] == [1.0, 1.0, 1.0]
    assert all(r["reward/failed_fraction"] == 1 / 8 for r in steps)
    assert "reward: 1 of 8 samples failed and are excluded" in proc.output


def test_a_service_that_breaks_mid_run_stops_it_naming_the_call_with_the_finished_steps_saved(tmp_path):
    run = tmp_path / "run"
    # requests 1-4: the evaluation before training (in-domain and OOD, greedy and sampled); 5, 6: steps 0 and 1
    with RewardServer(faults={"500": 1}, after=6, token="lab-secret-1234") as server:
        proc = _train(
            tmp_path,
            "configs/cpu/default.yaml",
            f"train.output_dir={run}",
            *SERVICE,
            f"reward.service.urls=[{server.url}]",
            "reward.service.token_env=LAB_TOKEN",
        )
    assert proc.returncode == 2 and "LAB_TOKEN: that environment variable is not set" in proc.output
    ENV["LAB_TOKEN"] = "lab-secret-1234"
    try:
        with RewardServer(faults={"500": 1}, after=6, token="lab-secret-1234") as server:
            proc = _train(
                tmp_path,
                "configs/cpu/default.yaml",
                f"train.output_dir={run}",
                *SERVICE,
                f"reward.service.urls=[{server.url}]",
                "reward.service.token_env=LAB_TOKEN",
            )
    finally:
        del ENV["LAB_TOKEN"]
    assert proc.returncode == 1, proc.output[-3000:]
    assert "reward.functions[0] (service) failed on sample 0" in proc.output and "answered 500" in proc.output
    assert "saved" in proc.output.splitlines()[-1] and (run / "checkpoints" / "step_000002").is_dir()
    written = proc.output + (run / "config.yaml").read_text() + (run / "metrics.jsonl").read_text()
    written += "".join(p.read_text(errors="ignore") for p in run.rglob("*.json"))
    assert "lab-secret-1234" not in written
    assert "token_env: LAB_TOKEN" in (run / "config.yaml").read_text()
