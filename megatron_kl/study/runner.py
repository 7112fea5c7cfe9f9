"""Run a study's grid locally, one training process per run (a crash stays in its run), resumable.

* A run that wrote ``summary.json`` and is recorded ``ok`` is kept; any other is (re)started, and its trainer
  resumes from its own last checkpoint, so a step is never trained or logged twice.
* ``status.json`` records every run's state after each run (written whole, then renamed into place): ``ok``,
  ``failed`` (the trainer's exit code and log tail) or ``interrupted`` (a stop signal reached it: it is run again,
  never counted as failed).
* The study holds ``<output_dir>/.lock`` while it runs: a second study on the same directory is refused like a
  second trainer on a run directory.
* The trainer dies with the study: it gets SIGTERM from the kernel when the study ends in any way, kill -9
  included (``PR_SET_PDEATHSIG``), so it saves its finished steps and stops. The stop signals the study receives
  (SIGTERM, SIGINT, SIGHUP, SIGUSR1: Ctrl-C, ``kill``, Slurm's time limit or preemption) go to the running
  trainer; once it has saved and stopped, the study stops too with the trainer's code (75, or 130 for SIGINT).
* A run directory still locked by a trainer of an earlier study that is saving its last checkpoint is waited for
  (up to ``LOCK_WAIT_S``) before its run starts again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from megatron_kl.child_processes import die_with_parent
from megatron_kl.config import ConfigError
from megatron_kl.study.grid import RunSpec, StudyConfig
from megatron_kl.train.metrics import read_metrics

log = logging.getLogger("megatron_kl.study")
OK, FAILED, INTERRUPTED = "ok", "failed", "interrupted"
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
LOCK_WAIT_S = 300.0  # a trainer of a killed study saving its finished steps
STOP_GRACE_S = 600.0  # a trainer given SIGTERM at the study's timeout, before SIGKILL


class StudyStopped(Exception):
    """A stop signal ended the study after its running trainer saved and stopped; ``exit_code``: 75 or 130."""

    def __init__(self, signal_name: str, done: int, total: int):
        self.exit_code = 130 if signal_name == "SIGINT" else 75
        super().__init__(
            f"stopped by {signal_name} with {done} of {total} runs done; run the same command again to "
            f"continue (the interrupted run resumes from its last checkpoint) (exit code {self.exit_code})"
        )


def _tail(path: Path, lines: int = 15) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def outcome_line(run_dir: Path, seconds: float) -> str:
    """One finished run in a line: its time, last reward and exact KL, and the final evaluation."""
    parts = [f"ok in {seconds:.1f} s"]
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in records if r.get("reward/mean") is not None]
    if steps:
        parts.append(f"final reward {steps[-1]['reward/mean']:.3f}")
        if steps[-1].get("kl/exact_token") is not None:
            parts.append(f"exact KL {steps[-1]['kl/exact_token']:.2e}")
    evals = [r for r in records if r.get("eval/id/pass@1") is not None]
    if evals:
        parts.append(f"ID pass@1 {evals[-1]['eval/id/pass@1']:.3f}")
        if evals[-1].get("eval/ood/pass@1") is not None:
            parts.append(f"OOD pass@1 {evals[-1]['eval/ood/pass@1']:.3f}")
    return ", ".join(parts)


def read_status(output_dir) -> dict:
    """``status.json`` of a study (empty before its first run); a damaged file is named, never half-read."""
    path = Path(output_dir) / "status.json"
    if not path.is_file():
        return {}
    try:
        status = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"{path} is damaged ({err}): move it aside to run every run's state again "
            "(finished runs keep their summary.json and are not retrained)"
        ) from None
    if not isinstance(status, dict) or not all(isinstance(v, dict) for v in status.values()):
        raise ConfigError(f"{path} is damaged: it must map run names to their states; move it aside")
    return status


def _write_status(path: Path, status: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(status, indent=2))
    os.replace(tmp, path)


class _Forwarder:
    """The study's stop-signal handlers: the first signal is recorded, every one goes on to the running trainer."""

    def __init__(self):
        self.received: Optional[str] = None
        self.child: Optional[subprocess.Popen] = None
        self._previous = {}
        for name in STOP_SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            log.warning(
                "received %s: the running trainer saves its finished steps and stops, then the study stops",
                self.received,
            )
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _wait_for_run_lock(run_dir: Path, forwarder: _Forwarder) -> None:
    from megatron_kl.run.run_dir import holder

    deadline, said = time.monotonic() + LOCK_WAIT_S, False
    while (who := holder(run_dir)) is not None:
        if forwarder.received or time.monotonic() > deadline:
            raise ConfigError(
                f"{run_dir} is still in use by {who} after {LOCK_WAIT_S:g} s: stop that trainer (it "
                "is not this study's), then run the study again"
            )
        if not said:
            log.info("waiting for %s to release %s (a trainer of an earlier study saving its steps)", who, run_dir)
            said = True
        time.sleep(0.5)


def _run_one(study: StudyConfig, spec: RunSpec, log_file: Path, forwarder: _Forwarder, timeout_s: float) -> int:
    cmd = [
        sys.executable,
        "-m",
        "megatron_kl.cli",
        "train",
        "--config",
        study.base,
        *spec.overrides,
        "logging.progress=false",
    ]
    parent = os.getpid()
    with open(log_file, "a") as handle:  # an earlier attempt's lines are kept above this one's
        handle.write(f"\n==== start {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        handle.flush()
        child = subprocess.Popen(
            cmd, stdout=handle, stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM)
        )
        forwarder.child = child
        try:
            return child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s: over the study's %g s per run: SIGTERM, the trainer saves and stops", spec.name, timeout_s)
            child.send_signal(signal.SIGTERM)
            try:
                return child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                return child.wait()
        finally:
            forwarder.child = None


def run_study(study: StudyConfig, runs: list[RunSpec], timeout_s: float = 6 * 3600) -> dict:
    """Every run not yet ``ok``, in order; the status of all. Raises :class:`StudyStopped` after a stop signal."""
    from megatron_kl.run.run_dir import RunLock

    out = Path(study.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    lock = RunLock(
        out, "one study runs in a study's output_dir at a time; wait for it to end, or give another output_dir"
    )
    forwarder = _Forwarder()
    try:
        status_file = out / "status.json"
        status = read_status(out)
        for index, spec in enumerate(runs):
            if (spec.output_dir / "summary.json").is_file() and status.get(spec.name, {}).get("state") == OK:
                log.info("[%d/%d] %s: done already", index + 1, len(runs), spec.name)
                continue
            if forwarder.received:
                break
            _wait_for_run_lock(spec.output_dir, forwarder)
            log_file = out / "logs" / f"{spec.name}.log"
            log.info("[%d/%d] %s", index + 1, len(runs), spec.name)
            start = time.perf_counter()
            code = _run_one(study, spec, log_file, forwarder, timeout_s)
            entry = {
                "configuration": spec.configuration,
                "seed": spec.seed,
                "output_dir": str(spec.output_dir),
                "returncode": code,
                "seconds": round(time.perf_counter() - start, 1),
                "log": str(log_file),
            }
            if code == 0 and (spec.output_dir / "summary.json").is_file():
                entry["state"] = OK
                log.info(
                    "[%d/%d] %s: %s", index + 1, len(runs), spec.name, outcome_line(spec.output_dir, entry["seconds"])
                )
            elif forwarder.received:
                entry["state"] = INTERRUPTED
                log.warning(
                    "%s interrupted by %s (exit %s); it resumes when the study runs again",
                    spec.name,
                    forwarder.received,
                    code,
                )
            else:
                entry["state"] = FAILED
                entry["error_tail"] = _tail(log_file)
                log.warning("%s failed (exit %s); log tail:\n%s", spec.name, code, entry["error_tail"])
            status[spec.name] = entry
            _write_status(status_file, status)
        if forwarder.received:
            done = sum(1 for spec in runs if status.get(spec.name, {}).get("state") == OK)
            raise StudyStopped(forwarder.received, done, len(runs))
        return status
    finally:
        forwarder.close()
        lock.release()
