"""A study as one NeMo-Run experiment of sbatch jobs: every run lands in its directory, the report is written, and
a run made to fail is reported failed with its log tail while the others finish."""

from __future__ import annotations

import json

import yaml


def test_a_study_runs_as_sbatch_jobs_and_reports_a_failed_run_with_its_log(slurm_cluster, warm_cache, tmp_path):
    missing = tmp_path / "no-such-warm-start.pt"
    study = {
        "name": "slurm-study",
        "base": "configs/cpu/default.yaml",
        "output_dir": str(tmp_path / "study"),
        "seeds": [1],
        "common": [
            "train.steps=2",
            "eval.interval=2",
            "checkpoint.interval=0",
            "logging.tensorboard=false",
            "kl.target=sequence_reverse",
            "task.eval_size=16",
            f"warm_start.cache_dir={warm_cache}",
            "launch.slurm.retries=0",
        ],
        "configurations": [
            {"name": "k1-reward-rtg", "overrides": ["kl.estimator=k1", "kl.placement=reward", "kl.coef=0.1"]},
            {"name": "k3-loss-token", "overrides": ["kl.estimator=k3", "kl.placement=loss", "kl.coef=0.1"]},
            {"name": "broken", "overrides": ["kl.coef=0", f"warm_start.checkpoint={missing}"]},
        ],
    }
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))
    launched = slurm_cluster.launch("slurm", "--cluster", "ci", "--config", str(config), timeout=900)
    assert launched.returncode == 1, launched.stdout[-3000:] + launched.stderr[-3000:]  # one run failed
    status = json.loads((tmp_path / "study" / "status.json").read_text())
    assert {name: entry["state"] for name, entry in status.items()} == {
        "k1-reward-rtg-seed1": "ok",
        "k3-loss-token-seed1": "ok",
        "broken-seed1": "failed",
    }
    assert f"warm_start.checkpoint='{missing}' names no file" in status["broken-seed1"]["error_tail"]
    for name in ("k1-reward-rtg-seed1", "k3-loss-token-seed1"):
        assert (tmp_path / "study" / "runs" / name / "summary.json").is_file()
    assert (tmp_path / "study" / "report.md").is_file()
