"""The user-editable recipes in launch/: their dry runs submit exactly what `megatron-kl launch` submits with the
cluster's settings as overrides; `launch/validate.py` on Slurm is a one-node job running `megatron-kl validate`,
and here (no GPU) it runs the CPU subset and reports it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nemo_run")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))
from clusters import CLUSTERS  # noqa: E402

PAPER = "configs/paper/qwen2.5-7b.yaml"
STUDY = "configs/study/qwen2.5-7b.yaml"
CPU = "configs/cpu/default.yaml"


def _run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _normalized(text: str) -> str:
    """The submitted scripts (NeMo-Run's console log before them is not compared); experiment ids
    (title_<timestamp>) and NeMo-Run's random torchrun rendezvous id differ between two dry runs, nothing else may."""
    scripts = re.sub(r"_\d{9,}", "_<id>", text[text.index("# ---- task ") :])
    return re.sub(r"--rdzv-id \d+", "--rdzv-id <id>", scripts)


@pytest.mark.parametrize(
    "recipe, cluster, config",
    [("train.py", "h100_login", PAPER), ("study.py", "h100_login", STUDY), ("train.py", "local", CPU)],
)
def test_recipe_dryrun_equals_megatron_kl_launch(tmp_path, recipe, cluster, config):
    places = [f"launch.home={tmp_path / 'home'}", f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}"]
    if recipe == "study.py":  # NeMo-Run git-archives the code once per task (105 here, ~0.9 s each); the
        places.append("launch.slurm.packager=none")  # packager is compared on the train.py cases
    mine = _run(f"launch/{recipe}", "--cluster", cluster, "--config", config, "--dryrun", *places).stdout
    spec = CLUSTERS[cluster]()
    theirs = _run(
        "-m", "megatron_kl.cli", "launch", spec.executor, "--config", config, "--dryrun", *spec.overrides(), *places
    ).stdout
    assert _normalized(mine) == _normalized(theirs)
    if spec.executor == "slurm":  # the cluster's settings really reached the script
        assert "#SBATCH --account=my-account" in mine and "#SBATCH --partition=h100" in mine
        assert "#SBATCH --signal=USR1@300" in mine
        assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in mine
        assert "export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7" in mine
        assert "export NCCL_NVLS_ENABLE=1" in mine  # the YAML-independent defaults stay
    if recipe == "study.py":
        assert mine.count("# ---- task ") > 1


def test_command_line_overrides_win_over_the_cluster(tmp_path):
    out = _run(
        "launch/train.py",
        "--cluster",
        "h100_login",
        "--config",
        PAPER,
        "--dryrun",
        f"launch.home={tmp_path / 'home'}",
        f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}",
        "launch.slurm.partition=debug",
        "launch.slurm.signal_lead_s=0",
    ).stdout
    assert "#SBATCH --partition=debug" in out and "#SBATCH --partition=h100" not in out
    assert "--signal" not in out and "PET_SIGNALS_TO_HANDLE" not in out


CUSTOMIZED = """
import json, sys
sys.path.insert(0, "launch")
from clusters import CLUSTERS
from megatron_kl.launch import experiment
from megatron_kl.launch.cluster import Cluster

base, seen = CLUSTERS["h100_login"](), []

def customize(executor):
    seen.append(type(executor).__name__)
    executor.mem = "0"

cluster = Cluster(base.executor, base.launch, customize)
plan = experiment.plan(sys.argv[1], [*cluster.overrides(), *sys.argv[2:]])
scripts = experiment.dryrun("slurm", plan, cluster.customize)
print(json.dumps({"seen": seen, "tasks": len(plan.tasks), "scripts": list(scripts.values())}))
"""


def test_customize_hook_edits_every_executor(tmp_path):
    """(NeMo-Run's dry run reads stdin: in a subprocess, not under pytest's capture.)"""
    out = _run(
        "-c",
        CUSTOMIZED,
        STUDY,
        f"launch.home={tmp_path / 'home'}",
        f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}",
        "launch.slurm.packager=none",
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    # one executor per task, two for a heterogeneous (disaggregated SGLang) task
    assert len(result["seen"]) >= result["tasks"] > 1 and set(result["seen"]) == {"SlurmExecutor"}
    assert all("#SBATCH --mem=0" in script for script in result["scripts"])


def test_recipe_names_the_right_recipe_for_the_config(tmp_path):
    done = _run("launch/train.py", "--cluster", "local", "--config", "configs/study/cpu.yaml", ok=False)
    assert done.returncode == 2 and "use launch/study.py" in done.stderr
    done = _run("launch/train.py", "--cluster", "h100_login", "--config", PAPER, "launch.slurm.nodez=2", ok=False)
    assert done.returncode == 2 and "launch.slurm.nodez" in done.stderr


def test_validate_on_slurm_is_one_node_running_megatron_kl_validate(tmp_path):
    out = _run(
        "launch/validate.py",
        "--cluster",
        "h100_login",
        "--dryrun",
        "--only",
        "layouts,train",
        f"launch.home={tmp_path / 'home'}",
        f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}",
    ).stdout
    lines = out.splitlines()
    for line in (
        "#SBATCH --nodes=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --account=my-account",
        "export TORCHX_MAX_RETRIES=0",
    ):
        assert line in lines, line
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--container-image nvcr.io/nvidia/nemo:25.09" in srun
    assert "python -m megatron_kl.cli validate --out runs/validate --only layouts,train" in srun
    assert "torchrun" not in srun  # the checks start their own ranks
    done = _run("launch/validate.py", "--cluster", "local", ok=False)
    assert done.returncode == 2 and "drop --cluster" in done.stderr


def test_validate_without_gpus_runs_the_cpu_subset_and_reports(tmp_path):
    report_path = tmp_path / "report.json"
    done = _run(
        "-m",
        "megatron_kl.cli",
        "validate",
        "--out",
        str(tmp_path / "out"),
        "--json",
        str(report_path),
        "--only",
        "gpu_tests,vocab_parallel,train",
    )
    assert "no GPU on this node" in done.stderr
    report = json.loads(report_path.read_text())
    assert report["gpus"] == 0 and report["cpu_subset"] and report["passed"]
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"gpu_tests": "skip", "vocab_parallel": "pass", "train": "pass"}
    timings = report["timings"]
    assert timings["steps"] == 3 and timings["step_s"] > timings["weight_sync_s"] > 0
    assert timings["tokens_per_s_per_gpu"] > 0
    assert re.search(r"^vocab_parallel\s+pass\s+\d+\.\d", done.stdout, re.M)  # the table
    assert '"checks"' not in done.stdout and "validate: passed; the report: " in done.stdout  # JSON only when asked
