"""``megatron-kl launch slurm --cluster ci``: NeMo-Run submits to a real Slurm (two virtual nodes of this machine),
sbatch runs srun + torchrun across both nodes (one trainer rank per node, data parallel), the job completes,
``megatron-kl launch status`` and ``sacct`` agree, and the run directory equals the same run under torchrun."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT

CONFIG = "configs/cpu/default.yaml"
VOLATILE = ("time/", "throughput/")


def common(cache: str) -> list[str]:
    return ["train.steps=2", "eval.interval=0", "checkpoint.interval=1", f"warm_start.cache_dir={cache}",
            "logging.tensorboard=false"]


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def experiment_id(stdout: str) -> str:
    found = re.search(r"^experiment: (\S+)", stdout, re.M)
    assert found, stdout[-2000:]
    return found.group(1)


def job_id(cluster, exp: str) -> str:
    status = cluster.launch("status", exp, "--home", "runs/launch_ci", timeout=120)
    found = re.search(r"job (\d+)", status.stdout)
    assert found, status.stdout + status.stderr
    return found.group(1)


def test_a_training_job_runs_on_two_nodes_and_equals_torchrun(slurm_cluster, warm_cache, tmp_path):
    run, reference = tmp_path / "slurm", tmp_path / "torchrun"
    launched = slurm_cluster.launch("slurm", "--cluster", "ci", "--config", CONFIG, f"train.output_dir={run}",
                                    *common(warm_cache))
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "train: SUCCEEDED" in launched.stdout
    exp = experiment_id(launched.stdout)
    status = slurm_cluster.launch("status", exp, "--home", "runs/launch_ci", timeout=120)
    assert status.returncode == 0 and "SUCCEEDED" in status.stdout, status.stdout + status.stderr
    job = job_id(slurm_cluster, exp)
    steps = {row["job"]: row for row in slurm_cluster.sacct(job)}
    assert steps[job]["state"] == "COMPLETED" and steps[job]["nodes"] == "mkl-n[1-2]", steps
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "megatron_kl.cli", "train", "--config", CONFIG,
                           f"train.output_dir={reference}", *common(warm_cache)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert metrics(run) == metrics(reference)
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
