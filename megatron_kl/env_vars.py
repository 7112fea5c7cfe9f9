"""The environment variables megatron-kl reads, parsed strictly: a value outside a variable's spelling is an
error naming the variable, what it may hold and the value, never a silent default.

======================  =====================================================================================
variable                values
======================  =====================================================================================
MEGATRON_KL_TRITON      auto (or unset, empty): Triton kernels on CUDA tensors when triton imports;
                        on (1, true, yes): required (CPU tensors: under TRITON_INTERPRET=1); off (0, false, no)
MEGATRON_KL_TRITON_BLOCK  a power of two >= 16: the kernels' column block cap (tests)
MEGATRON_KL_NATIVE      on / off: the C top-p search (off: its torch path)
MEGATRON_KL_RANKS_START forkserver (default) or spawn: how CPU test ranks start
MEGATRON_KL_CACHE       a directory: where the C kernels are built (default ~/.cache/megatron-kl)
MEGATRON_KL_PARENT_PID  a process id: the trainer stops (as on SIGTERM) when that process ends
                        (``megatron-kl launch local`` sets it: its trainers die with it)
======================  =====================================================================================

:func:`check_environment` parses every one (``megatron-kl train --check`` and every start call it); the readers
below parse the one they need. This module imports nothing of the package.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

ON, OFF, AUTO = "on", "off", "auto"
_SWITCH = {
    "1": ON,
    "true": ON,
    "on": ON,
    "yes": ON,
    "0": OFF,
    "false": OFF,
    "off": OFF,
    "no": OFF,
    "": AUTO,
    "auto": AUTO,
}


class EnvVarError(ValueError):
    """An environment variable holds a value it cannot (the message names it, its values and the fix)."""


def _raw(name: str, environ: Optional[Mapping[str, str]]) -> str:
    return (os.environ if environ is None else environ).get(name, "").strip()


def switch(name: str, environ: Optional[Mapping[str, str]] = None, allow_auto: bool = True) -> str:
    """``on``, ``off`` or ``auto`` (unset or empty: auto; without ``allow_auto``: auto is refused)."""
    raw = _raw(name, environ)
    value = _SWITCH.get(raw.lower())
    if value is None or (value == AUTO and raw and not allow_auto):
        spelled = "auto, " if allow_auto else ""
        raise EnvVarError(
            f"environment variable {name}={raw!r}: use {spelled}1/true/on/yes or 0/false/off/no (or unset it)"
        )
    return value


def flag(name: str, default: bool, environ: Optional[Mapping[str, str]] = None) -> bool:
    value = switch(name, environ, allow_auto=False)
    return default if value == AUTO else value == ON


def choice(name: str, choices: tuple[str, ...], default: str, environ: Optional[Mapping[str, str]] = None) -> str:
    raw = _raw(name, environ)
    if not raw:
        return default
    if raw not in choices:
        raise EnvVarError(f"environment variable {name}={raw!r}: use one of {list(choices)} (or unset it)")
    return raw


def power_of_two(name: str, minimum: int, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """A power of two >= ``minimum``, or None when unset."""
    raw = _raw(name, environ)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < minimum or value & (value - 1):
        raise EnvVarError(f"environment variable {name}={raw!r}: use a power of two >= {minimum} (or unset it)")
    return value


def process_id(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """A positive process id, or None when unset."""
    raw = _raw(name, environ)
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise EnvVarError(f"environment variable {name}={raw!r}: use a process id (a positive integer), or unset it")
    return int(raw)


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every variable megatron-kl reads; the first bad one raises :class:`EnvVarError`."""
    switch("MEGATRON_KL_TRITON", environ)
    power_of_two("MEGATRON_KL_TRITON_BLOCK", 16, environ)
    flag("MEGATRON_KL_NATIVE", True, environ)
    choice("MEGATRON_KL_RANKS_START", ("forkserver", "spawn"), "forkserver", environ)
    process_id("MEGATRON_KL_PARENT_PID", environ)
