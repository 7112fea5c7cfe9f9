"""``train.output_dir``: which run it holds, who writes it, and what a start does to it.

* :func:`plan_start` (every rank, before any process group exists; reads JSON only) decides how a start
  proceeds: ``fresh``, ``resume`` (the newest complete checkpoint records the same run identity,
  run/identity.py) or ``finished`` (it is at ``train.steps`` and its ``summary.json`` is written). A resume
  whose identity differs is a :class:`RunRefused` (exit 2) listing the differing fields, before anything in
  the directory changes.
* :class:`RunLock`: an ``flock`` on ``<output_dir>/.lock`` held for the run's lifetime (only rank 0 under
  torchrun); the kernel drops it when the process dies, kill -9 included, so a lock is never stale. A second
  trainer is refused naming the holder's pid and host.
* :func:`begin`: a fresh start in a directory that holds an earlier run's files moves them, untouched, into
  ``superseded-<UTC time>/`` (one log line); ``config.yaml`` is written by a fresh start only, and every start
  appends a line to ``starts.jsonl`` (:func:`record_start`, once its checkpoint is loaded: time, kind, the step
  of the checkpoint actually loaded, code version, host, the resumable fields it changed).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import os
import socket
import subprocess
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

import yaml

from megatron_kl import child_processes
from megatron_kl.config import ConfigError, redact_secrets, to_dict
from megatron_kl.run import identity
from megatron_kl.run.checkpoint import RUN_FILE, complete_checkpoints, step_of, verified_run_record
from megatron_kl.run.summary import read_summary

log = logging.getLogger("megatron_kl.train")

LOCK_FILE = ".lock"
STARTS = "starts.jsonl"


class RunRefused(ConfigError):
    """This start would mix two runs or two writers in one directory (exit code 2, nothing changed)."""


@dataclasses.dataclass
class StartPlan:
    kind: str  # fresh | resume | finished
    run_id: str
    checkpoint_step: int = 0
    recorded_config: Optional[dict] = None
    identity: dict = dataclasses.field(default_factory=dict)  # this configuration's (computed once per start)
    start_entry: Optional[dict] = None  # begin()'s starts.jsonl line, written once the checkpoint is loaded


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The package version, and the git commit when running from a checkout."""
    try:
        text = version("megatron-kl")
    except PackageNotFoundError:
        text = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if commit.returncode == 0:
            text += f"+g{commit.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return text


def run_record(cfg, plan: StartPlan) -> dict:
    """What a checkpoint records of its run (``run.json``)."""
    return {
        "run_id": plan.run_id,
        "run_name": cfg.run_name,
        "code_version": code_version(),
        "identity": plan.identity,
        "config": redact_secrets(to_dict(cfg)),
    }


def _ways_out(run_dir: Path) -> str:
    return (
        f"choose another train.output_dir, or set checkpoint.resume=false to start a new run in {run_dir} "
        f"(the files there are moved, not deleted, into {run_dir}/superseded-<time>/)"
    )


def plan_start(cfg, world_size: int, current: Optional[dict] = None) -> StartPlan:
    """``current``: this configuration's identity when already computed (it hashes the data files)."""
    run_dir = Path(cfg.train.output_dir)
    current = identity.identity_of(cfg, world_size) if current is None else current
    checkpoints = complete_checkpoints(run_dir / "checkpoints") if cfg.checkpoint.resume else []
    if not checkpoints:
        return StartPlan("fresh", uuid.uuid4().hex, identity=current)
    newest = None
    for path in reversed(checkpoints):  # the newest checkpoint whose run record matches its manifest
        record, problem = verified_run_record(path)
        if record is not None:
            newest = (path, record)
            break
        log.warning("checkpoint %s: %s; trying the previous checkpoint", path, problem)
    if newest is None:
        raise RunRefused(
            f"the checkpoints under {run_dir / 'checkpoints'} record no run identity ({RUN_FILE} "
            "missing or unreadable: written by an older megatron-kl, or damaged), so resuming them "
            f"could mix two runs: {_ways_out(run_dir)}"
        )
    path, record = newest
    diffs = identity.differences(record["identity"], current, type(cfg))
    if diffs:
        raise RunRefused(
            f"{run_dir} holds run {record.get('run_name', '?')} (checkpoint {path.name}) and this "
            f"configuration differs in {len(diffs)} field(s) that change what a run computes: "
            + "; ".join(diffs)
            + f". Nothing was changed: {_ways_out(run_dir)}"
        )
    step = step_of(path)
    if cfg.train.steps < step:
        raise RunRefused(
            f"train.steps={cfg.train.steps} is below the step of the newest checkpoint in {run_dir} "
            f"({step}): set train.steps >= {step} to continue the run, or {_ways_out(run_dir)}"
        )
    kind = "resume"
    if cfg.train.steps == step:
        summary = read_summary(run_dir)
        if summary is not None and summary.steps == step and summary.run_id == record.get("run_id"):
            kind = "finished"
    return StartPlan(kind, str(record.get("run_id") or uuid.uuid4().hex), step, record.get("config"), current)


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` for this process's lifetime (or until :meth:`release`);
    refused naming the holder and ``what`` to do. :func:`holder` reads it without taking it."""

    def __init__(
        self,
        run_dir: Path,
        what: str = "one trainer writes a train.output_dir at a time; wait for it to "
        "end, or choose another train.output_dir",
    ):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            self._fd = None
            raise RunRefused(f"{run_dir} is in use by {holder}: {what}") from None
        child_processes.install(close_fds=(self._fd,))  # forked helpers never inherit the lock
        os.ftruncate(self._fd, 0)
        os.pwrite(
            self._fd,
            f"pid {os.getpid()} on host {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode(),
            0,
        )

    def release(self) -> None:
        if self._fd is not None:
            child_processes.forget_fd(self._fd)
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def holder(run_dir: Path) -> Optional[str]:
    """Who holds ``run_dir``'s lock (its pid line), or None when nobody does."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # closing drops a lock taken here
    return None


def _move_aside(run_dir: Path) -> Optional[Path]:
    """Move an earlier run's files into ``superseded-<UTC time>/``; None when there were none."""
    old = [p for p in run_dir.iterdir() if p.name != LOCK_FILE]
    if not old:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / f"superseded-{stamp}"
    suffix = 1
    while target.exists():
        target, suffix = run_dir / f"superseded-{stamp}-{suffix}", suffix + 1
    target.mkdir()
    for path in old:
        path.rename(target / path.name)
    return target


def begin(cfg, plan: StartPlan, world_size: int) -> None:
    """Rank 0, holding the lock: prepare the directory for this start and record it."""
    run_dir = Path(cfg.train.output_dir)
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kind": plan.kind,
        "from_step": plan.checkpoint_step,
        "run_id": plan.run_id,
        "code_version": code_version(),
        "host": socket.gethostname(),
        "world_size": world_size,
    }
    if plan.kind == "fresh":
        moved = _move_aside(run_dir)
        if moved is not None:
            log.warning(
                "%s held an earlier run's files; moved them to %s (a fresh start never mixes or deletes them)",
                run_dir,
                moved,
            )
            entry["moved_aside"] = str(moved)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(redact_secrets(to_dict(cfg)), sort_keys=False))
    else:
        entry["changed"] = identity.changed_resumable(
            plan.recorded_config or {}, redact_secrets(to_dict(cfg)), type(cfg)
        )
    plan.start_entry = entry


def record_start(run_dir: Path, entry: dict, from_step: int) -> None:
    """Rank 0: append this start's line to ``starts.jsonl`` with the step of the checkpoint actually loaded (a
    damaged newer one may have been passed over)."""
    entry = {**entry, "from_step": from_step}
    with open(Path(run_dir) / STARTS, "a") as f:
        f.write(json.dumps(entry) + "\n")
