"""A real two-node Slurm cluster (scripts/slurm_cluster.sh) for the tests of this folder, started once per session
and stopped at its end. They run where ``MEGATRON_KL_SLURM=1`` (CI's Slurm stage, or a root shell with the Debian
packages installable); elsewhere they are skipped, so the full tier does not need Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
ENABLE = "MEGATRON_KL_SLURM"
CONFIG = "configs/cpu/default.yaml"
# long enough (~0.5 s a step on 2 cores: ~50 s of training) that a time-limit signal, which Slurm sends at its
# first periodic check (every ~30 s) after it is due, still finds the job training
PREEMPTED = ["train.steps=100", "eval.interval=0", "checkpoint.interval=5", "logging.tensorboard=false"]


@dataclass
class SlurmCluster:
    directory: Path
    env: dict

    def run(
        self, *command: str, timeout: float = 60, check: bool = True, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(command),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            cwd=ROOT,
        )

    def launch(self, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
        """``megatron-kl launch`` with the CI cluster of launch/clusters.py; a submission gets a rendezvous port of its
        own (a run killed in a fault test can leave its c10d store listening on the old one). ``env``: added to the
        submitting environment, which sbatch passes on to the job."""
        if args and args[0] == "slurm":
            args = (*args, f"launch.slurm.rdzv_port={free_port()}")
        return self.run(sys.executable, "-m", "megatron_kl.cli", "launch", *args, timeout=timeout, check=False, env=env)

    def sacct(self, job_id: str, duplicates: bool = False) -> list[dict]:
        """sacct's records of a job and its steps; ``duplicates``: every start of a requeued job, oldest first."""
        out = self.run(
            "sacct",
            "-n",
            "-P",
            *(["-D"] if duplicates else []),
            "-j",
            job_id,
            "-o",
            "JobID,State,ExitCode,NodeList,Start",
        ).stdout
        keys = ("job", "state", "exit", "nodes", "start")
        return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range: a port the kernel handed out for ``bind(0)`` is in
    that range, where any outgoing connection made before the job binds it (Slurm's RPCs, the accounting database,
    HTTP) may take it; below it only a listening socket can."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(20000, max(low, 20001))
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(directory: Path, port: int | None = None) -> SlurmCluster:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    if port is not None:
        env["SLURM_CLUSTER_PORT"] = str(port)
    done = subprocess.run(
        ["bash", str(SCRIPT), "start", str(directory)], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode:
        subprocess.run(["bash", str(SCRIPT), "stop", str(directory)], env=env, capture_output=True, timeout=120)
        pytest.fail(f"the Slurm cluster did not start:\n{done.stderr[-3000:]}")
    env["SLURM_CONF"] = str(directory / "etc" / "slurm.conf")
    return SlurmCluster(directory, env)


def stop(cluster: SlurmCluster) -> None:
    subprocess.run(
        ["bash", str(SCRIPT), "stop", str(cluster.directory)], env=cluster.env, capture_output=True, timeout=120
    )


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if os.environ.get(ENABLE) != "1":
        pytest.skip(f"Slurm tests run with {ENABLE}=1 (CI's Slurm stage; root and the Debian packages needed)")
    cluster = start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop(cluster)


@pytest.fixture(scope="session")
def uninterrupted(warm_cache, tmp_path_factory):
    """PREEMPTED run once without interruption under torchrun (two ranks): what every Slurm run of it must equal."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "-m",
            "megatron_kl.cli",
            "train",
            "--config",
            CONFIG,
            f"train.output_dir={out}",
            f"warm_start.cache_dir={warm_cache}",
            *PREEMPTED,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/slurm/" in item.nodeid:
            item.add_marker(pytest.mark.slurm)
