"""Spawn N ranks on this machine and run a function in each.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes that join one process group
(nccl with one GPU per rank when there are enough GPUs; gloo otherwise, the ranks then seeing no GPU, so that they
run the CPU path whole instead of placing models on a GPU that gloo's collectives cannot serve) through a file
rendezvous, calls ``fn(rank, world_size,
*args)`` in each and returns the per-rank return values. A failing rank's traceback is raised in the
parent; a rank that hangs past ``timeout_s`` kills the whole group and fails with a clear message.
``fn`` must be importable (module-level) so the spawned children can find it. Tensors in the returned values
(nested in dicts, lists, tuples, named tuples and dataclasses) come back on the CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import queue
import signal
import tempfile
import traceback
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from megatron_kl.child_processes import stop_when_gone
from megatron_kl.env_vars import choice


class RankFailure(RuntimeError):
    pass


def _backend(world_size: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def to_device(value, device):
    """``value`` with its tensors (nested in dicts, lists, tuples, named tuples and dataclass instances) moved to
    ``device``; the rest as it is. A dataclass instance is copied (fields set on the copy, so init=False and
    frozen fields are kept), never mutated."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((key, to_device(item, device)) for key, item in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_device(item, device) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(moved, f.name, to_device(getattr(value, f.name), device))
        return moved
    return value


@contextmanager
def _gpus_hidden(hide: bool):
    """Within: CUDA_VISIBLE_DEVICES is empty (when ``hide``), so processes started here see no GPU."""
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if hide:
            if previous is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous


def _worker(rank, world_size, init_file, fn, args, results, threads, backend, environ, caller):
    # dies with its caller (a killed `megatron-kl convert` leaves no rank behind): watched, since a rank's parent
    # is the fork server, which outlives a killed caller as long as any rank holds its pipe
    stop_when_gone(caller, signal.SIGKILL)
    try:
        warnings.filterwarnings("ignore")
        os.environ.clear()  # the caller's environment now (a forked child starts with the fork server's)
        os.environ.update(environ)
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        torch.distributed.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        value = to_device(fn(rank, world_size, *args), "cpu")  # a GPU rank's tensors come back on the CPU
        buffer = io.BytesIO()  # plain bytes: shared-memory tensors would die with this process
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - surfaced to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _context():
    """Where ranks start: on a machine without CUDA, forked from a fork server that has imported torch,
    megatron-core and the trainer once (each spawned interpreter would import them again: ~4 s per rank on 2 CPU
    cores); the server imports only (no process group), so a fork of it is as clean as a fresh interpreter, and the
    caller's environment is handed to each rank. With CUDA (where an import such as Transformer Engine's may create a
    CUDA context, which a fork cannot inherit) or MEGATRON_KL_RANKS_START=spawn: spawned."""
    if torch.cuda.is_available() or choice("MEGATRON_KL_RANKS_START", ("forkserver", "spawn"), "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first call)
    return ctx


PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron_kl.train.loop")


def run_ranks(fn, world_size: int, *args, timeout_s: float = 300.0, threads_per_rank: int = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return values by rank."""
    ctx = _context()
    results = ctx.Queue()
    backend = _backend(world_size)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        with _gpus_hidden(backend == "gloo" and torch.cuda.is_available()):  # the ranks get this environment
            environ = dict(os.environ)
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, fn, args, results, threads_per_rank, backend, environ, os.getpid()),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        values: dict[int, object] = {}
        failures: dict[int, str] = {}
        try:
            while len(values) + len(failures) < world_size:
                try:
                    rank, ok, value = results.get(timeout=timeout_s)
                except queue.Empty:
                    alive = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise RankFailure(
                        f"{fn.__name__}: no result within {timeout_s}s; ranks still running: {alive}; "
                        f"finished: {sorted(values)}; failed: {sorted(failures)}"
                    ) from None
                if ok:
                    values[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failures[rank] = value
                if failures:
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not failures else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            rank = min(failures)
            raise RankFailure(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{failures[rank]}")
        return [values[r] for r in range(world_size)]
