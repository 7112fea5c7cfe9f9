"""Checkpoints of a run's registered state (run/run_state.py): model and optimizer as sharded tensors with
megatron.core.dist_checkpointing (any rank layout reads them back), the shared parts (LR schedule, RL-step and
optimizer-step counters) in ``trainer.pt``, each rank's parts (RNG states, the async rollout queue) in
``rank_XXXXX.pt``, and ``run.json``: the run's id and identity (run/run_dir.py).

A checkpoint is written to ``step_XXXXXX.tmp``; once every rank has finished, the size and SHA-256 of every
file go into ``MANIFEST.json`` (run/manifest.py), then rank 0 writes the completion marker ``COMPLETE``
(carrying the manifest's digest) last and renames the directory. Only ``step_<digits>`` directories with
the marker count, so a run killed mid-save (kill -9), a stray directory or a copy in progress is never
resumed from. Before anything of a checkpoint is read, every file is checked against the manifest: a
missing, truncated, bit-flipped or planted file is reported naming the file, and the previous complete
checkpoint is used (every rank agrees on which). Nothing is read with the general unpickler: our files with
``torch.load(weights_only=True)``, DCP's ``.metadata`` and shard objects with the restricted loaders of
run/safe_unpickle.py, so a pickle placed in a checkpoint never executes. Retention deletes only
checkpoints of the run that is writing.
"""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron_kl.models.output_head import unwrap
from megatron_kl.run import manifest
from megatron_kl.run.run_state import RunState
from megatron_kl.run.safe_unpickle import restricted_checkpoint_reads

_PREFIX = "step_"
_NAME = re.compile(r"step_(\d+)")
MARKER = "COMPLETE"
RUN_FILE = "run.json"  # the run's id, identity, resolved config and code version (run/run_dir.py)

log = logging.getLogger(__name__)


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded_state_dict(train_state, is_loading: bool) -> dict:
    """Model chunks under ``model`` (``model0``, ``model1``... with virtual stages) and the optimizer."""
    sharded = {
        key: unwrap(chunk).sharded_state_dict()
        for key, chunk in zip(_model_keys(train_state.chunks), train_state.chunks)
    }
    model_flat = {}
    for value in sharded.values():
        model_flat.update(value)
    sharded["optimizer"] = train_state.optimizer.sharded_state_dict(model_flat, is_loading=is_loading)
    return sharded


def read_run_record(checkpoint: Path) -> Optional[dict]:
    try:
        record = json.loads((Path(checkpoint) / RUN_FILE).read_text())
        return record if isinstance(record, dict) and isinstance(record.get("identity"), dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def step_of(checkpoint: Path) -> int:
    return int(_NAME.fullmatch(Path(checkpoint).name).group(1))


def marker_step(checkpoint: Path) -> Optional[int]:
    """The step the completion marker records (written with the manifest's digest); None where unreadable."""
    try:
        for line in (Path(checkpoint) / MARKER).read_text(errors="replace").splitlines():
            if line.startswith("step "):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


_MISNAMED: set = set()  # checkpoints already reported as misnamed (complete_checkpoints runs often)


def complete_checkpoints(directory: Path) -> list[Path]:
    """``step_<digits>`` directories with the completion marker, oldest first; one whose marker records another
    step than its name (renamed or copied into place) is left out, said once."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        if (m := _NAME.fullmatch(p.name)) and p.is_dir() and (p / MARKER).is_file():
            recorded = marker_step(p)
            if recorded != int(m.group(1)):
                if str(p) not in _MISNAMED:
                    _MISNAMED.add(str(p))
                    log.warning(
                        "%s: its %s records step %s, not the step %d of its name (renamed or copied into "
                        "place): not used",
                        p,
                        MARKER,
                        recorded,
                        int(m.group(1)),
                    )
                continue
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def verified_run_record(checkpoint: Path) -> tuple[Optional[dict], Optional[str]]:
    """(``run.json``'s record, None) when the file matches the checkpoint's manifest, else (None, why): a start
    compares identities only with a record it has verified."""
    problem = manifest.verify_file(Path(checkpoint), MARKER, RUN_FILE)
    if problem is not None:
        return None, problem
    record = read_run_record(checkpoint)
    return (record, None) if record is not None else (None, f"{Path(checkpoint) / RUN_FILE} is not a run record")


def _results_queue_without_spawn() -> None:
    """megatron's torch_dist writer collects its results through a queue served by a multiprocessing
    Manager it starts with the *spawn* method on the first save; spawn re-imports ``__main__``, so a user
    script without an ``if __name__ == "__main__":`` guard would run again there (and die on the trainer's
    ports: EADDRINUSE / EOFError). A fork-started Manager serves the same queue without importing anything;
    megatron forks its writer processes anyway."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def save_checkpoint(
    directory: Path, step: int, run_state: RunState, run_record: dict, keep: int = 2, free_before_write: bool = False
) -> Path:
    """Collective: the checkpoint of ``step`` finished RL steps. ``run_record`` and ``run_state.shared`` are
    the same on all ranks (saved by rank 0), ``run_state.per_rank`` per rank. Keeps the ``keep`` (>= 1) newest
    complete checkpoints of this run (those whose ``run.json`` names ``run_record["run_id"]``); another run's
    checkpoints are never deleted. ``free_before_write``: where the free space is short of the previous
    checkpoint's size, this run's older checkpoints are deleted first (oldest first, never the newest)."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep={keep} must be >= 1 (the checkpoint just written)")
    if run_state.counters.rl_steps != step:
        raise ValueError(f"checkpoint of step {step} with the RL-step counter at {run_state.counters.rl_steps}")
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    final = directory / f"{_PREFIX}{step:06d}"
    tmp = directory / f"{_PREFIX}{step:06d}.tmp"
    previous = complete_checkpoints(directory)
    needed = _size_of(previous[-1]) if previous else 0  # the last checkpoint's size: this one's, near enough
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if free_before_write and _no_space(directory, needed, step):
            _free_space(directory, needed, step, run_record["run_id"])
    dist.barrier()
    error = _no_space(directory, needed, step)
    if error is None:
        try:
            _results_queue_without_spawn()
            dist_checkpointing.save(_sharded_state_dict(run_state.train_state, is_loading=False), str(tmp))
            torch.save(run_state.rank_state(), tmp / f"rank_{dist.get_rank():05d}.pt")
            if dist.get_rank() == 0:
                torch.save(run_state.shared_state(), tmp / "trainer.pt")
                (tmp / RUN_FILE).write_text(json.dumps(run_record, indent=1, default=str))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            error = _write_error(err, tmp, needed, step)
    if not _all_ok(error is None):
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial checkpoint taking the space
        where = f"; the previous checkpoint {previous[-1]} is intact" if previous else ""
        raise CheckpointWriteError(f"{error or 'writing the checkpoint failed on another rank'}{where}")
    digest = manifest.write_manifest(tmp, MARKER, cpu_group())
    if dist.get_rank() == 0:
        (tmp / MARKER).write_text(manifest.marker_text(step, digest))  # last: everything before it is on disk
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in _own_checkpoints(directory, run_record["run_id"])[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


class CheckpointError(RuntimeError):
    """No complete checkpoint could be loaded."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (no space left, an I/O error); the partial one is removed."""


def _own_checkpoints(directory: Path, run_id: str) -> list[Path]:
    """The complete checkpoints whose ``run.json`` names ``run_id``, oldest first (the only ones ever deleted)."""
    return [p for p in complete_checkpoints(directory) if (read_run_record(p) or {}).get("run_id") == run_id]


def _free_space(directory: Path, needed: int, step: int, run_id: str) -> None:
    """Delete this run's older complete checkpoints, oldest first, keeping the newest, until ``needed`` fits."""
    for old in _own_checkpoints(directory, run_id)[:-1]:
        if not _no_space(directory, needed, step):
            return
        log.warning(
            "checkpoint of step %d: %s deleted first to make room (checkpoint.free_before_write=true)", step, old
        )
        shutil.rmtree(old, ignore_errors=True)


def _size_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def _no_space(directory: Path, needed: int, step: int) -> Optional[str]:
    free = shutil.disk_usage(directory).free
    if needed and free < needed * 1.05:
        return (
            f"no space left on device for the checkpoint of step {step}: it needs about {needed / 2**20:.1f} MiB "
            f"(the size of the previous one) under {directory}, {free / 2**20:.1f} MiB are free; free space there, "
            "or set checkpoint.free_before_write=true (this run's older checkpoints are deleted first, the newest "
            "kept), then run the same command again"
        )
    return None


def _write_error(err: BaseException, tmp: Path, needed: int, step: int) -> str:
    """One line for a failed write; a full disk said as such (torch's zip writer reports it as
    "unexpected pos"), with the path and the space needed."""
    text = _reason(err)
    full = getattr(err, "errno", None) == errno.ENOSPC or "No space left" in text or "unexpected pos" in text
    if full:
        free = shutil.disk_usage(tmp.parent).free
        need = f"about {needed / 2**20:.1f} MiB" if needed else "more space than is free"
        return (
            f"no space left on device writing the checkpoint of step {step} to {tmp} (it needs {need}; "
            f"{free / 2**20:.1f} MiB free): free space there, or set checkpoint.free_before_write=true (this run's "
            "older checkpoints are deleted first, the newest kept), then run the same command again"
        )
    return f"writing the checkpoint of step {step} to {tmp} failed: {text}"


def _load_file(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, or not plain data (a pickle is never run)
        raise ValueError(f"{path} does not load as plain data ({_reason(err)})") from None


def _all_ok(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group())
    return bool(flag.item())


_GLOO = None  # (the default group it was made for, the gloo group)


def cpu_group():
    """A CPU group for the load agreement (the default group may be NCCL); made again for a new default group
    (a second run in the same process)."""
    global _GLOO
    world = dist.group.WORLD
    if _GLOO is None or _GLOO[0] is not world:
        _GLOO = (world, dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else world)
    return _GLOO[1]


def load_checkpoint(path: Path, run_state: RunState, run_id: Optional[str] = None) -> None:
    """Load every registered part of ``run_state`` from the checkpoint at ``path``. Raises (naming the file)
    when any part of this checkpoint is missing or damaged, or (``run_id`` given) when it belongs to another
    run, on every rank (``run_state`` may then be partly loaded: load another checkpoint into it)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    damage = manifest.verify(path, MARKER, cpu_group())
    record = read_run_record(path) if damage is None else None
    if damage is None and record is None:
        damage = f"{path / RUN_FILE} is not a run record (JSON with the run's identity)"
    elif damage is None and run_id is not None and record.get("run_id") != run_id:
        damage = f"{path / RUN_FILE} belongs to run {record.get('run_id')}, not to {run_id}"
    if damage is not None:
        raise CheckpointError(f"checkpoint {path}: {damage}")
    error = None
    train_state = run_state.train_state
    try:
        shared = _load_file(path / "trainer.pt")
        rank_state = _load_file(path / f"rank_{dist.get_rank():05d}.pt")
        for name, state in (("trainer.pt", shared), (f"rank_{dist.get_rank():05d}.pt", rank_state)):
            if not isinstance(state, dict):
                raise ValueError(f"{path / name} is not a dict of states")
    except Exception as err:  # noqa: BLE001 - reported and agreed on below
        error = err
    if not _all_ok(error is None):
        raise CheckpointError(f"checkpoint {path}: {error or 'damaged on another rank'}")
    try:
        with restricted_checkpoint_reads():
            loaded = dist_checkpointing.load(_sharded_state_dict(train_state, is_loading=True), str(path))
        for key, chunk in zip(_model_keys(train_state.chunks), train_state.chunks):
            unwrap(chunk).load_state_dict(loaded[key])
        train_state.optimizer.load_state_dict(loaded["optimizer"])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; a truncated
        error = err  # .distcp surfaces here on every rank (DCP gathers the readers' errors)
    if not _all_ok(error is None):
        shard = _shard_problem(path) if error is not None else None
        raise CheckpointError(f"checkpoint {path}: model/optimizer shards unreadable ({shard or _reason(error)})")
    try:
        run_state.load_shared(shared, str(path / "trainer.pt"))
        run_state.load_rank(rank_state, str(path / f"rank_{dist.get_rank():05d}.pt"))
    except Exception as err:  # noqa: BLE001 - a state that does not fit this run's parts
        error = err
    if not _all_ok(error is None):
        raise CheckpointError(f"checkpoint {path}: {_reason(error)}")


def _shard_problem(path: Path) -> Optional[str]:
    """Which shard file DCP could not read, where its own error does not say (a truncated or replaced .distcp
    gives a bare EOFError): each file the .metadata addresses must exist and hold the bytes it addresses."""
    try:
        with restricted_checkpoint_reads():
            metadata = FileSystemReader(str(path)).read_metadata()
        extent: dict = {}
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            extent[info.relative_path] = max(extent.get(info.relative_path, 0), info.offset + info.length)
    except Exception as err:  # noqa: BLE001 - the .metadata itself is the bad file
        return f"{path / '.metadata'} does not load ({_reason(err)})"
    for name, end in sorted(extent.items()):
        shard = path / name
        if not shard.is_file():
            return f"{shard} is missing (addressed by {path / '.metadata'})"
        if shard.stat().st_size < end:
            return (
                f"{shard} holds {shard.stat().st_size} bytes, {path / '.metadata'} addresses {end} (not the shard "
                "written with it)"
            )
    for extra in sorted(path.glob("*.json")) + sorted(path.glob("common*.pt")):  # megatron's own files beside DCP's
        try:
            if extra.suffix == ".json":
                json.loads(extra.read_text())
            else:
                torch.load(extra, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - named, never run (weights_only)
            return f"{extra} does not load ({_reason(err)})"
    return None


def _reason(error: Optional[BaseException]) -> str:
    """One line for a load failure: DCP wraps each rank's exception (with its traceback) in ``failures``."""
    if error is None:
        return "on another rank"
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        error = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback summary) per rank
    text = (str(error).strip().splitlines() or [""])[0]
    if "Weights only load failed" in text:
        text = "a pickle referencing objects that no checkpoint contains; it was not loaded"
    return f"{type(error).__name__}: {text[:400]}"


def load_latest(directory: Path, run_state: RunState, run_id: Optional[str] = None) -> Optional[Path]:
    """Load the newest complete checkpoint under ``directory`` that loads into ``run_state``, falling back to
    older ones (each failure logged with its file); its path, or None when there is none. A directory whose
    checkpoints all fail to load is a CheckpointError listing why."""
    failures = []
    for path in reversed(complete_checkpoints(directory)):
        try:
            load_checkpoint(path, run_state, run_id)
        except CheckpointError as err:
            log.error("%s; trying the previous checkpoint", err)
            failures.append(str(err))
            continue
        return path
    if failures:
        raise CheckpointError(
            "no checkpoint under {} loads: {}. Set checkpoint.resume=false to start a new run "
            "there (its files are moved into superseded-<time>/, not deleted) or choose another "
            "train.output_dir".format(directory, "; ".join(failures))
        )
    return None
