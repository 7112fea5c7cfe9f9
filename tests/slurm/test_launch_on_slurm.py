"""``megatron-kl launch slurm --cluster ci``: NeMo-Run submits to a real Slurm (two virtual nodes of this machine),
sbatch runs srun + torchrun across both nodes (one trainer rank per node, data parallel), the job completes,
``megatron-kl launch status`` and ``sacct`` agree, and the run directory equals the same run under torchrun."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.slurm.conftest import CONFIG, PREEMPTED, ROOT

VOLATILE = ("time/", "throughput/")


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def experiment_id(stdout: str) -> str:
    found = re.search(r"^experiment: (\S+)", stdout, re.M)
    assert found, stdout[-2000:]
    return found.group(1)


def experiment_dir(exp: str) -> Path:
    """The experiment's directory under the CI cluster's home (job ids restart at 1 with every new cluster: a
    search by job id alone finds older experiments' logs)."""
    found = list(Path(ROOT, "runs", "launch_ci", "experiments").glob(f"*/{exp}"))
    assert len(found) == 1, found
    return found[0]


def job_id(cluster, exp: str) -> str:
    status = cluster.launch("status", exp, "--home", "runs/launch_ci", timeout=120)
    found = re.search(r"job (\d+)", status.stdout)
    assert found, status.stdout + status.stderr
    return found.group(1)


def test_a_training_job_runs_on_two_nodes_and_equals_torchrun(slurm_cluster, warm_cache, tmp_path, uninterrupted):
    """The run the preemption tests interrupt, launched whole: the same metrics as under torchrun."""
    run = tmp_path / "slurm"
    launched = slurm_cluster.launch(
        "slurm",
        "--cluster",
        "ci",
        "--config",
        CONFIG,
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        *PREEMPTED,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "train: SUCCEEDED" in launched.stdout
    exp = experiment_id(launched.stdout)
    status = slurm_cluster.launch("status", exp, "--home", "runs/launch_ci", timeout=120)
    assert status.returncode == 0 and "SUCCEEDED" in status.stdout, status.stdout + status.stderr
    job = job_id(slurm_cluster, exp)
    assert settled_starts(slurm_cluster, job) == ["COMPLETED"]
    steps = {row["job"]: row for row in slurm_cluster.sacct(job)}
    assert steps[job]["state"] == "COMPLETED" and steps[job]["nodes"] == "mkl-n[1-2]", steps
    assert metrics(run) == metrics(uninterrupted)
    assert json.loads((run / "summary.json").read_text())["steps"] == 100


def wait_until(predicate, timeout: float, what: str, interval: float = 1.0, explain=None):
    """``predicate()`` once it is truthy; a failure after ``timeout`` seconds, with ``explain()`` (what the cluster
    and the job's logs show) in its message when given."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    detail = ""
    if explain is not None:
        try:
            detail = "\n" + explain()
        except Exception as error:  # the diagnosis must not hide the timeout
            detail = f"\n(no diagnosis: {error!r})"
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


def diagnosis(cluster, exp: str, job: str | None, tail: int = 2500) -> str:
    """What a timed-out wait shows: the queue, the nodes, the job's accounting and the tail of every log of the
    experiment (a CI failure is read from its output alone)."""
    parts = [
        cluster.run("squeue", "-a", "-o", "%i %T %R %N", check=False).stdout,
        cluster.run("sinfo", "-N", "-o", "%N %T %E", check=False).stdout,
    ]
    if job:
        parts.append(json.dumps(cluster.sacct(job, duplicates=True)))
        parts.append(cluster.run("scontrol", "show", "job", job, check=False).stdout)
    controller = cluster.directory / "log" / "slurmctld.log"  # the scheduler's decisions (a het job: backfill)
    if controller.is_file():
        parts.append("--- slurmctld.log ---\n" + "\n".join(controller.read_text(errors="replace").splitlines()[-40:]))
    for log in sorted(experiment_dir(exp).rglob("*.out")):
        parts.append(f"--- {log.name} ---\n" + log.read_text(errors="replace")[-tail:])
    return "\n".join(parts)


ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUE_HOLD", "RESIZING"}


def settled_starts(cluster, job: str, name: str | None = None) -> list[str]:
    """The states of the starts of ``name`` (default: the job itself; a het job's first component ``JOB+0``), oldest
    first, once accounting has recorded how the last one ended: slurmdbd can lag squeue by seconds, so a job gone
    from the queue may still read RUNNING in sacct."""
    name = name or job

    def states():
        found = [r["state"] for r in cluster.sacct(job, duplicates=True) if r["job"] == name]
        return found if found and found[-1] not in ACTIVE else None

    return wait_until(
        states,
        90,
        f"the accounting of {name}'s last start",
        explain=lambda: json.dumps(cluster.sacct(job, duplicates=True)),
    )


def by_step(run: Path) -> dict:
    """The last row logged for each step (a resumed run logs the steps after its checkpoint again)."""
    return {row["step"]: row for row in metrics(run) if "step" in row}


def steps_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max([json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()] or [0])


def job_state(cluster, job: str) -> str:
    out = cluster.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()
    return out or "GONE"


LONG = 250


def start_requeued_now(cluster, job: str, *updates: str, components: int = 1) -> None:
    """Start a requeued (PENDING) job at once - Slurm would hold it ~2 minutes (its begin time) - once the previous
    run's batch script has ended and its completion has reached the controller: started earlier, the old batch
    step's end is taken for the new run's (its second start then FAILS at once, with no log)."""
    import time

    import psutil

    def old_batch_running() -> bool:
        titles = (f"[{job}.batch]", f"[{job}+0.batch]")
        return any(
            any(t in " ".join(p.info["cmdline"] or []) for t in titles) for p in psutil.process_iter(["cmdline"])
        )

    wait_until(lambda: not old_batch_running(), 120, "the previous run's batch step to end")
    time.sleep(5)
    for component in range(components):  # a het job: every component's start time
        cluster.run("scontrol", "update", f"JobId={int(job) + component}", "StartTime=now", *updates, check=False)


def _requeued_and_resumed(cluster, exp: str, job: str, run: Path) -> None:
    """After the stop: the job requeues itself (its sbatch script), runs again at once (Slurm would hold a requeued
    job ~2 minutes: its start time is moved to now, its time limit restored), resumes and completes."""
    explain = lambda: diagnosis(cluster, exp, job)  # noqa: E731
    wait_until(lambda: job_state(cluster, job) == "PENDING", 180, f"job {job} to requeue itself", explain=explain)
    start_requeued_now(cluster, job, "TimeLimit=15")
    wait_until(lambda: job_state(cluster, job) == "GONE", 600, f"job {job} to finish its second run", explain=explain)
    assert settled_starts(cluster, job) == ["REQUEUED", "COMPLETED"], cluster.sacct(job, duplicates=True)
    logs = list(experiment_dir(exp).rglob(f"log-megatron-kl.train_{job}_1.out"))
    assert logs, "no log of the second run (SLURM_RESTART_COUNT=1)"
    lines = (run / "starts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1]).get("kind") == "resume", lines
    status = cluster.launch("status", exp, "--home", "runs/launch_ci", timeout=120)
    assert "SUCCEEDED" in status.stdout, status.stdout + status.stderr


@pytest.mark.parametrize("how", ["scancel_signal", "time_limit"])
def test_a_preempted_job_checkpoints_requeues_and_resumes_to_the_same_metrics(
    slurm_cluster, warm_cache, tmp_path, uninterrupted, how
):
    run = tmp_path / "run"
    # Slurm's time-limit signal comes at its periodic check, up to ~60 s after it is due here: this variant trains
    # long enough (250 steps, ~2 minutes) to be still training then
    time_limit = ["launch.slurm.signal_lead_s=150", f"train.steps={LONG}"] if how == "time_limit" else []
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
        *time_limit,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    exp = experiment_id(launched.stdout)
    job = job_id(slurm_cluster, exp)
    wait_until(
        lambda: steps_done(run) >= 2,
        300,
        "two training steps",
        interval=0.2,
        explain=lambda: diagnosis(slurm_cluster, exp, job),
    )
    if how == "scancel_signal":
        slurm_cluster.run("scancel", "--signal=USR1", job)
    else:  # the time limit moved to 90-150 s from now, inside the 150 s lead: Slurm sends USR1 at its next periodic
        # check (~30 s). Set at submission instead, the signal can come up to a minute early - before the trainer
        # has started (it then stops with nothing to save, correctly, and the test would not see a checkpoint)
        used = slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%M").stdout.strip()  # [H:]M:SS
        seconds = sum(int(part) * 60**i for i, part in enumerate(reversed(used.split(":"))))
        slurm_cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={-(-(seconds + 90) // 60)}")
    _requeued_and_resumed(slurm_cluster, exp, job, run)
    if how == "scancel_signal":
        assert by_step(run) == by_step(uninterrupted)
    else:  # the same run and resume mechanics as above; here it is the signal's source that is tested
        assert sorted(by_step(run)) == list(range(LONG + 1))
