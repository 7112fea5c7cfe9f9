"""Jobs that survive their cluster: a signal (Slurm's ``--signal=USR1@lead`` or preemption's SIGTERM) sent to
torchrun, or rollout servers that die mid-run, end in a checkpoint of the last finished step and exit code 75;
running the same command again resumes there and every step is logged exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_kl.config.launch import stop_signal_env
from megatron_kl.rollout.servers import server_port
from megatron_kl.run.checkpoint import complete_checkpoints
from megatron_kl.run.preemption import REQUEUE_EXIT_CODE
from megatron_kl.train.metrics import read_metrics
from tests.e2e.runs import DEFAULT, ROOT
from tests.e2e.test_sglang import TEST_SERVER

COMMON = [
    "train.prompts_per_step=4",
    "train.group_size=4",
    "task.eval_size=8",
    "eval.k=2",
    "eval.interval=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.interval=0",
]


class Torchrun:
    """``torchrun -m megatron_kl.cli train`` with the environment the Slurm scripts export (torchrun forwards
    SIGUSR1 to the workers and waits for them)."""

    def __init__(self, log: Path, nproc: int, *overrides: str):
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **stop_signal_env(120)}
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            env.pop(key, None)
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    str(nproc),
                    "--master-port",
                    str(server_port()),
                    "-m",
                    "megatron_kl.cli",
                    "train",
                    "--config",
                    str(DEFAULT),
                    *COMMON,
                    *overrides,
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait(self, timeout: float = 600) -> tuple[int, str]:
        return self.proc.wait(timeout=timeout), self.log.read_text()


def _logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path) if "reward/mean" in r] if path.is_file() else []


def _resume_and_check(tmp_path: Path, run: Path, steps: int, stopped_at: int, *overrides: str) -> None:
    code, output = Torchrun(tmp_path / "resumed.log", 2, *overrides).wait()
    assert code == 0, output[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped_at:06d}'} at RL step {stopped_at}" in output
    assert _logged_steps(run) == list(range(steps))  # every step once: none lost, none repeated


def test_sigusr1_to_torchrun_checkpoints_the_finished_step_and_exits_for_requeue(tmp_path, warm_cache):
    run, steps = tmp_path / "run", 12
    overrides = (
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        f"train.steps={steps}",
        "parallel.tensor_parallel=2",
        "train.staleness=1",
    )
    job = Torchrun(tmp_path / "first.log", 2, *overrides)
    deadline = time.time() + 400
    while not _logged_steps(run):
        assert job.proc.poll() is None and time.time() < deadline, job.log.read_text()[-3000:]
        time.sleep(0.05)
    job.proc.send_signal(signal.SIGUSR1)  # to torchrun only, as Slurm's cgroup signal reaches it first
    code, output = job.wait()
    assert code != 0, "torchrun must exit nonzero so the sbatch script requeues the job"
    assert "received SIGUSR1" in output and f"exit code {REQUEUE_EXIT_CODE}" in output, output[-3000:]
    checkpoints = complete_checkpoints(run / "checkpoints")
    stopped_at = len(_logged_steps(run))
    assert 1 <= stopped_at < steps, "the run finished before the signal: the test is void"
    assert [p.name for p in checkpoints] == [f"step_{stopped_at:06d}"]  # the finished step, nothing else
    _resume_and_check(tmp_path, run, steps, stopped_at, *overrides)


def test_rollout_server_dying_mid_run_checkpoints_and_resumes(tmp_path, warm_cache):
    """A managed server that dies and may not be restarted (as a disaggregated server the trainer does not own):
    every rank learns it together (async rollouts at TP=2), the finished steps are checkpointed, exit 75."""
    run, steps, marker = tmp_path / "run", 8, tmp_path / "died"
    overrides = (
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        f"train.steps={steps}",
        "parallel.tensor_parallel=2",
        "train.staleness=1",
        "rollout.engine=sglang",
        "rollout.sglang.weight_sync=from_disk",
        f"rollout.sglang.server_module={TEST_SERVER}",
        "rollout.sglang.restart_dead_servers=false",
        "rollout.sglang.max_retries=1",
        "rollout.sglang.backoff_s=0.05",
    )
    faults = f"rollout.sglang.extra_args=[--fault-exit-at, '90', --fault-marker, '{marker}']"
    code, output = Torchrun(
        tmp_path / "first.log", 2, *overrides, f"rollout.sglang.port={server_port()}", faults
    ).wait()
    assert marker.is_file(), output[-3000:]
    assert code != 0 and "rollout engine lost" in output, output[-3000:]
    stopped_at = len(_logged_steps(run))
    assert 1 <= stopped_at < steps, output[-3000:]
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == [f"step_{stopped_at:06d}"]
    # the same command again (the fault marker keeps the server alive this time)
    _resume_and_check(tmp_path, run, steps, stopped_at, *overrides, f"rollout.sglang.port={server_port()}", faults)
