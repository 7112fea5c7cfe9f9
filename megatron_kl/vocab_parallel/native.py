"""The C kernels of the CPU top-p search (``top_p_search.c``), built on first use and loaded with ctypes.

Built once per source, compiler and CPU by the system C compiler (``$CC``, else ``cc``) with
``-O3 -march=native`` into ``$MEGATRON_KL_CACHE`` (default ``~/.cache/megatron-kl``), the way Triton builds its
launchers at run time; the file name carries a digest of all three, so a cache shared by different machines
never hands one CPU another's instructions, and a build is written to a temporary name and renamed, so
concurrent ranks never load half a file. Without a compiler, or with ``MEGATRON_KL_NATIVE=0``, ``library()`` is
None and callers use their torch path (a warning says why, once). ctypes releases the GIL during a call, so
``run_rows`` splits rows over threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from megatron_kl import env_vars

SOURCE = Path(__file__).with_name("top_p_search.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-std=c11")
log = logging.getLogger(__name__)

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = {
    "histogram_f32": [_P, _I64, _I64, _I64, _I64, _P, _P, _F32, _I32, _P],
    "refine_f32": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _F32, _I32, _I32, _P, _P, _P, _I32, _P, _P],
    "extremes_f32": [_P, _I64, _I64, _I64, _I64, _P, _P],
    "top_p_rows_f32": [
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        ctypes.c_double,
        ctypes.c_double,
        _I32,
        _I32,
        _I32,
        _I32,
        _P,
        _P,
        _P,
        _P,
    ],
}


def _cpu_digest() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(dict.fromkeys(wanted))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC") or "cc")


def _build(compiler: str, cache: Path, flags=FLAGS) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(flags), _cpu_digest()]).encode())
    target = cache / f"top_p_search-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode:
            raise RuntimeError(f"{compiler} failed (rc {result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def _build_any(compiler: str, cache: Path) -> Path:
    """``-march=native`` first; a compiler that does not know it (some targets spell it -mcpu) builds without."""
    try:
        return _build(compiler, cache)
    except RuntimeError as native_error:
        portable = tuple(flag for flag in FLAGS if not flag.startswith("-march="))
        try:
            return _build(compiler, cache, portable)
        except RuntimeError:
            raise native_error from None


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (disabled, no compiler, or the build failed: warned once)."""
    if not env_vars.flag("MEGATRON_KL_NATIVE", True):
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (set CC): the top-p search uses its slower torch path")
        return None
    cache = Path(os.environ.get("MEGATRON_KL_CACHE") or Path.home() / ".cache" / "megatron-kl")
    try:
        lib = ctypes.CDLL(str(_build_any(compiler, cache)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("building %s failed, the top-p search uses its slower torch path: %s", SOURCE.name, exc)
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib


@functools.cache
def _pool(threads: int, pid: int) -> ThreadPoolExecutor:
    """One pool per process (keyed by pid: a forked child inherits a pool whose threads it does not have)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="megatron-kl-native")


def run_rows(function, rows: int, *arguments) -> None:
    """``function(*arguments[:3], row_begin, row_end, *arguments[3:])`` over ``rows`` rows, split into
    ``torch.get_num_threads()`` contiguous ranges run in parallel (the C functions take those two slots
    after the pointer, row stride and column count)."""
    threads = max(1, min(torch.get_num_threads(), rows))
    head, tail = arguments[:3], arguments[3:]
    bounds = [(rows * i // threads, rows * (i + 1) // threads) for i in range(threads)]
    if threads == 1:
        function(*head, 0, rows, *tail)
        return
    pool = _pool(threads, os.getpid())
    for future in [pool.submit(function, *head, begin, end, *tail) for begin, end in bounds]:
        future.result()
