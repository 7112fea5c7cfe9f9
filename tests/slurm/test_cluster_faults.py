"""Faults on the real Slurm cluster: a job that fails on every start exhausts its retries and the experiment says
FAILED with the cause in its log; a node lost mid-run (its slurmd killed) leaves only whole checkpoints and the
requeued job resumes to the uninterrupted metrics; and the cluster script stops every daemon it started, with the
jobs still running on it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.slurm.conftest import CONFIG, PREEMPTED, start, stop
from tests.slurm.test_launch_on_slurm import (
    by_step,
    diagnosis,
    experiment_id,
    job_id,
    job_state,
    settled_starts,
    start_requeued_now,
    steps_done,
    wait_until,
)

DAEMONS = ("slurmctld", "slurmd", "slurmstepd", "munged", "mariadbd")


def test_a_job_failing_on_every_start_exhausts_its_retries_and_reports_why(slurm_cluster, warm_cache, tmp_path):
    missing = tmp_path / "no-such-warm-start.pt"  # checked where the job starts (a cluster's paths), not at submit
    launched = slurm_cluster.launch(
        "slurm",
        "--cluster",
        "ci",
        "--config",
        CONFIG,
        "--detach",
        f"train.output_dir={tmp_path / 'run'}",
        f"warm_start.checkpoint={missing}",
        "train.steps=2",
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    exp = experiment_id(launched.stdout)
    job = job_id(slurm_cluster, exp)
    wait_until(
        lambda: job_state(slurm_cluster, job) == "PENDING" and slurm_cluster.sacct(job, duplicates=True),
        180,
        "the first failure's requeue",
    )
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")  # Slurm holds a requeue ~2 minutes
    wait_until(lambda: job_state(slurm_cluster, job) == "GONE", 300, "the retry to end")
    starts = settled_starts(slurm_cluster, job)
    assert starts == ["REQUEUED", "FAILED"], starts  # launch.slurm.retries=1: one requeue, then failed for good
    status = slurm_cluster.launch("status", exp, "--home", "runs/launch_ci", timeout=120)
    assert status.returncode == 1 and "FAILED" in status.stdout, status.stdout + status.stderr
    logs = slurm_cluster.launch("logs", exp, "--home", "runs/launch_ci", timeout=120)
    assert "warm_start.checkpoint" in logs.stdout and str(missing) in logs.stdout, logs.stdout[-3000:]


def test_a_node_lost_mid_run_leaves_whole_checkpoints_and_the_requeued_job_resumes(
    slurm_cluster, warm_cache, tmp_path, uninterrupted
):
    from megatron_kl.run import checkpoint, manifest

    run = tmp_path / "run"
    launched = slurm_cluster.launch(
        "slurm",
        "--cluster",
        "ci",
        "--config",
        CONFIG,
        "--detach",
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        *PREEMPTED,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    exp = experiment_id(launched.stdout)
    job = job_id(slurm_cluster, exp)
    wait_until(
        lambda: steps_done(run) >= 7,
        300,
        "a checkpoint (step 5) and two more steps",
        interval=0.2,
        explain=lambda: diagnosis(slurm_cluster, exp, job),
    )
    import psutil

    def on_node_2(process) -> bool:
        try:
            env = process.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        return env.get("SLURMD_NODENAME") == "mkl-n2" and env.get("SLURM_JOB_ID") == job

    slurmd = psutil.Process(int((slurm_cluster.directory / "run" / "slurmd-mkl-n2.pid").read_text()))
    node = [slurmd, *filter(on_node_2, psutil.process_iter())]  # the node is gone: its slurmd and its job's tasks
    assert len(node) > 1, "no task of the job on mkl-n2"
    for process in node:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    slurm_cluster.run("scontrol", "update", "NodeName=mkl-n2", "State=DOWN", "Reason=lost in a test")
    wait_until(lambda: job_state(slurm_cluster, job) in ("PENDING", "GONE"), 180, "Slurm to end the job's run")
    for directory in sorted(run.glob("checkpoints/*")):  # what the crash left: whole checkpoints, or none
        if (directory / checkpoint.MARKER).is_file():
            assert manifest.verify(directory, checkpoint.MARKER) is None, directory
    subprocess.run(["slurmd", "-N", "mkl-n2"], env=slurm_cluster.env, check=True)  # the node comes back
    slurm_cluster.run("scontrol", "update", "NodeName=mkl-n2", "State=RESUME", check=False)  # or back by itself
    wait_until(lambda: "idle" in slurm_cluster.run("sinfo", "-h", "-n", "mkl-n2", "-o", "%T").stdout, 60, "mkl-n2 idle")
    if job_state(slurm_cluster, job) == "PENDING":  # requeued (sbatch --requeue): start it now, not in ~2 minutes,
        # once the lost run's batch script (on the surviving node) has ended
        start_requeued_now(slurm_cluster, job)
        wait_until(lambda: job_state(slurm_cluster, job) == "GONE", 600, "the requeued run to finish")
        assert by_step(run) == by_step(uninterrupted)
    else:  # failed for good: the same command resumes it
        assert (run / "checkpoints").is_dir()


def _processes_under(directory: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(directory) in line and any(d in line for d in DAEMONS)]


def test_stop_ends_every_daemon_and_job_the_cluster_started(tmp_path):
    import pytest

    if os.environ.get("MEGATRON_KL_SLURM") != "1":
        pytest.skip("Slurm tests run with MEGATRON_KL_SLURM=1")
    cluster = start(tmp_path / "cluster", port=17817)  # beside the session's cluster, on its own ports
    try:
        job = cluster.run(
            "sbatch", "--parsable", "-N2", "-o", str(cluster.directory / "job-%j.out"), "--wrap", "srun sleep 300"
        ).stdout.strip()
        wait_until(lambda: job_state(cluster, job) == "RUNNING", 60, "the job to run")
        pids = {
            name: int((cluster.directory / "run" / f"{name}.pid").read_text())
            for name in ("slurmctld", "slurmdbd", "munged", "mariadbd", "slurmd-mkl-n1", "slurmd-mkl-n2")
        }
    finally:
        stop(cluster)
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) is still running"
    assert not _processes_under(cluster.directory)
    out = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True, text=True).stdout.split()
    assert not out, f"the job's processes are still running: {out}"
    assert str(cluster.directory) not in Path("/etc/hosts").read_text()  # its node names removed
