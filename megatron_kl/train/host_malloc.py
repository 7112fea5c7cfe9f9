"""glibc malloc settings for CPU training (``train.host_malloc``).

On CPU every tensor lives in host memory from glibc's malloc. By default glibc serves blocks above a dynamic
threshold (128 KiB, raised up to 32 MiB as such blocks are freed) with fresh mmaps and returns heap memory
above 128 KiB at the top to the OS on free, so the per-step temporaries of a trainer (logits chunks, [B, V]
sampling buffers, activations) are often page-faulted anew on every use, at ~1 GB/s. Measured on 2 cores:
the embedded engine's sampling step over [32, 49152] logits took 1.3-8 ms depending on the heap's state
(1.3 ms with the settings below); in the tools/bench_trl.py trainer, interleaved off/auto pairs at the tiny
shape gave step medians 1.037/1.031, 1.097/1.061, 1.052/1.035 s (~2 % faster, peak RSS +0.01 GiB); at the
135M shape the difference is inside the run-to-run noise (17.7-18.3 s either way). PyTorch's CPU
performance guide recommends the same remedy (or jemalloc / tcmalloc, which are not installed here).

``auto``: on a CPU-only process with glibc, ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` (blocks below 32 MiB come
from the heap and are reused) and ``mallopt(M_TRIM_THRESHOLD, 1 GiB)`` (freed heap memory is kept for reuse
up to 1 GiB), unless the user set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (theirs win).
``off``: glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Optional

import torch

log = logging.getLogger(__name__)

MODES = ("auto", "off")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
SETTINGS = {"M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, 32 << 20, "MALLOC_MMAP_THRESHOLD_"),
            "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, 1 << 30, "MALLOC_TRIM_THRESHOLD_")}


def _glibc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def tune_host_malloc(mode: str, cuda: Optional[bool] = None) -> dict:
    """Apply ``mode`` (module docstring); returns the settings applied ({name: bytes}; empty when none)."""
    if mode not in MODES:
        raise ValueError(f"train.host_malloc={mode!r}: use one of {list(MODES)}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if mode == "off" or cuda:
        return {}
    libc = _glibc()
    if libc is None:
        return {}
    applied = {}
    for name, (option, value, env) in SETTINGS.items():
        if env in os.environ:
            continue
        if libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) != 1:
            log.warning("mallopt(%s, %d) failed; glibc's default stays", name, value)
            continue
        applied[name] = value
    if applied:
        log.info("train.host_malloc=auto: glibc %s", ", ".join(f"{k}={v}" for k, v in applied.items()))
    return applied
