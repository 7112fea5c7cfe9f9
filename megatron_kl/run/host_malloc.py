"""glibc malloc settings for CPU training (``train.host_malloc``).

On CPU every tensor lives in host memory from glibc's malloc. By default glibc serves blocks above a dynamic
threshold (128 KiB, raised up to 32 MiB as such blocks are freed) with fresh mmaps and returns heap memory
above 128 KiB at the top to the OS on free, so the per-step temporaries of a trainer (logits chunks, [B, V]
sampling buffers, activations) are often page-faulted anew on every use, at ~1 GB/s. Measured on 2 cores
with a first version of the settings (mmap threshold 32 MiB, trim threshold 1 GiB): the embedded engine's
sampling step over [32, 49152] logits took 1.3-8 ms depending on the heap's state (1.3 ms with them); the
tiny bench shape's step ~2 % faster; at the 135M shape the difference was inside the noise, because blocks
above 32 MiB were still mmapped per use and the heap was still trimmed after each backward (below). PyTorch's
CPU performance guide recommends the same remedy (or jemalloc / tcmalloc, which are not installed here).

``auto``: on a CPU-only process with glibc, ``mallopt(M_MMAP_MAX, 0)`` (no block is served by its own mmap:
every block, however large, comes from the heap and its pages are reused after free),
``mallopt(M_TRIM_THRESHOLD, -1)`` (freed heap memory is never handed back: the heap stays at the step's
high-water mark, as a caching allocator would) and ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` (for a user who allows
mmaps again), each unless the user set its ``MALLOC_*_`` variable (theirs win). Before the first two
(``M_TRIM_THRESHOLD`` was 1 GiB) a 135M-parameter bf16 update page-faulted 503k pages per step (the fused
output layer's 134 MB float32 chunks, RMSNorm's float32 temporaries, every saved activation after the previous
step's backward trimmed the heap); with them 128. tools/bench_step.py --trl-workload 135m, bf16, interleaved
pairs with the equivalent environment (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=16 GiB, MALLOC_TOP_PAD_=256 MiB)
against glibc's defaults: step 5.62/8.91 s and 5.47/7.26 s (update 3.06/5.69, 2.83/4.14 s; rollout 1.83/2.25 s),
peak RSS 6.90/7.03 and 7.04/7.05 GB, system CPU time of the whole run 23.3/32.6 s and 23.2/27.1 s; two later
runs with these mallopt settings: 6.55 and 5.86 s.
``off``: glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

MODES = ("auto", "off")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc malloc.h
NEVER = -1  # M_TRIM_THRESHOLD: "-1 disables trimming completely" (mallopt(3))
SETTINGS = {
    "M_MMAP_MAX": (M_MMAP_MAX, 0, "MALLOC_MMAP_MAX_"),
    "M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, 32 << 20, "MALLOC_MMAP_THRESHOLD_"),
    "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, NEVER, "MALLOC_TRIM_THRESHOLD_"),
}


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
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
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
        log.debug("train.host_malloc=auto: glibc %s", ", ".join(f"{k}={v}" for k, v in applied.items()))
    return applied
