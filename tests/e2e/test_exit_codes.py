"""The exit-code table of docs/checkpoints.md ("How a run ends") held on every rollout path: a server lost during a
weight update (restart off) and SIGTERM while a checkpoint is being written end in a checkpoint of the finished
steps and exit 75, with partial rollouts, delta sync and FP8 rollouts as without them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_kl.rollout.servers import server_port
from megatron_kl.run.checkpoint import complete_checkpoints
from megatron_kl.run.preemption import REQUEUE_EXIT_CODE
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
]
SERVED = [
    "rollout.engine=sglang",
    f"rollout.sglang.server_module={TEST_SERVER}",
    "rollout.sglang.max_retries=1",
    "rollout.sglang.backoff_s=0.05",
    "rollout.sglang.restart_dead_servers=false",
    "rollout.sampling.max_new_tokens=12",
]
PATHS = {  # the rollout paths of the table
    "async": ["train.staleness=1", "rollout.sglang.weight_sync=from_disk"],
    "partial": ["train.staleness=2", "rollout.partial=true", "rollout.sglang.weight_sync=from_disk"],
    "delta": ["train.staleness=1", "rollout.delta_sync=true", "rollout.sglang.weight_sync=from_tensor"],
    "fp8": ["train.staleness=1", "rollout.quantization=fp8", "rollout.sglang.weight_sync=from_tensor"],
}


def _start(run: Path, warm_cache: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    log = run.parent / f"{run.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_kl.cli",
                "train",
                "--config",
                str(DEFAULT),
                f"train.output_dir={run}",
                f"warm_start.cache_dir={warm_cache}",
                *COMMON,
                f"rollout.sglang.port={server_port()}",
                *overrides,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, log


def _assert_requeued(code: int, output: str, run: Path, reason: str) -> None:
    assert code == REQUEUE_EXIT_CODE, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert reason in last and "failed" not in last, last
    saved = [p.name for p in complete_checkpoints(run / "checkpoints")]
    assert saved and f"checkpoint {run / 'checkpoints' / saved[-1]}" in last, (saved, last)


@pytest.mark.parametrize("path", ["partial", "delta", "fp8"])  # async alone: tests/e2e/test_preemption.py
def test_a_server_lost_during_a_weight_update_exits_for_requeue(tmp_path, warm_cache, path):
    run, marker = tmp_path / "run", tmp_path / "died"
    in_flight = ", --token-latency-s, '0.1', --long-every, '3'" if path == "partial" else ""  # cut by the pause
    faults = f"rollout.sglang.extra_args=[--fault-exit-on-update, '3', --fault-marker, '{marker}'{in_flight}]"
    proc, log = _start(run, warm_cache, *SERVED, *PATHS[path], "train.steps=6", "checkpoint.interval=0", faults)
    code = proc.wait(timeout=600)
    assert marker.is_file(), "the server never reached the update that kills it: the test is void"
    _assert_requeued(code, log.read_text(), run, "rollout engine lost")


@pytest.mark.parametrize("path", ["embedded", "partial", "delta", "fp8"])
def test_sigterm_while_a_checkpoint_is_written_exits_for_requeue(tmp_path, warm_cache, path):
    """The signal lands while ``step_000002.tmp`` exists (the second checkpoint), generation in flight."""
    run = tmp_path / "run"
    served = (
        []
        if path == "embedded"
        else [*SERVED, *PATHS[path], "rollout.sglang.extra_args=[--token-latency-s, '0.1', --long-every, '3']"]
    )
    proc, log = _start(run, warm_cache, *served, "train.steps=30", "checkpoint.interval=1")
    writing = run / "checkpoints" / "step_000002.tmp"
    deadline = time.monotonic() + 500
    while not writing.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=300)
    _assert_requeued(code, log.read_text(), run, "received SIGTERM")
    assert not writing.exists()
    shutil.rmtree(run, ignore_errors=True)
