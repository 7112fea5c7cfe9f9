"""What a configuration field may hold, declared beside the field and enforced when a config is loaded.

    lr: float = checked(1e-5, ge=0)                      # a finite number >= 0
    lr_decay_style: str = checked("constant", choices=("constant", "linear", "cosine"))
    output_dir: str = checked("runs/{run_name}", path="writable")

``megatron_kl.config.from_dict`` (every YAML file and dotted override goes through it: ``train``, ``--check``,
``study``, ``launch``) checks each value against its field's :class:`Constraint` before the dataclass is built
and raises ``ConfigError`` with one line naming the field, what it may hold and the fix. Whatever the
constraint, numbers are never NaN, never true/false, and infinite only where declared (``finite=False``); a
string field without ``choices`` is declared free-form (``free=True``) or a path. ``megatron-kl config show``
prints each field's constraint. This module imports nothing of the package (every layer may use it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

PATH_KINDS = ("file", "dir", "writable")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and how to fix it."""


# the largest seed: numpy's legacy generator takes [0, 2^32); the derived seeds (train.seed * 7919 + step, ...)
# stay far inside torch's 64-bit range
SEED_MAX = 2**32 - 1
KEY = "megatron_kl.constraint"
_CHECK_PATHS = contextvars.ContextVar("megatron_kl_check_paths", default=True)


@contextlib.contextmanager
def paths_unchecked():
    """Load configs for another machine (``megatron-kl launch`` to a cluster): path fields are checked by the job
    where it starts, not here (a cluster's /models need not exist on the workstation)."""
    token = _CHECK_PATHS.set(False)
    try:
        yield
    finally:
        _CHECK_PATHS.reset(token)


@dataclass(frozen=True)
class Constraint:
    """Bounds (``ge`` / ``gt`` / ``le`` / ``lt``), ``choices``, or a path rule; ``fix``: what to do instead."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: Optional[tuple] = None
    finite: bool = True
    free: bool = False  # a free-form string (a name, a module, an address)
    path: Optional[str] = None  # file: must exist; dir: an existing directory; writable: a directory that can be made
    nonempty: bool = False
    fix: str = ""

    def __post_init__(self):
        if self.path is not None and self.path not in PATH_KINDS:
            raise ValueError(f"Constraint(path={self.path!r}): use one of {PATH_KINDS}")

    def describe(self) -> str:
        """What the field may hold, in words (``config show``)."""
        if self.choices is not None:
            plugins = ", or package.module:ATTR" if hasattr(self.choices, "resolve_error") else ""
            return "one of " + ", ".join(str(c) for c in self.choices) + plugins
        if self.path is not None:
            return {
                "file": "an existing file",
                "dir": "an existing directory",
                "writable": "a directory this process can create or write",
            }[self.path]
        bounds = [
            f"{op} {_number(bound)}"
            for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if bound is not None
        ]
        bounds = [b for b in bounds if b]
        if self.free:
            return "free text" + (", not empty" if self.nonempty else "")
        return ("finite, " if self.finite else "") + (" and ".join(bounds) if bounds else "any value")

    def violation(self, value: Any) -> Optional[str]:
        """Why ``value`` is not allowed (None: it is); ``value`` has already been coerced to the field's type."""
        if value is None:
            return None
        if isinstance(value, bool):  # bool fields are coerced separately; a bool here is a number given as true
            return None
        if isinstance(value, (int, float)):
            if isinstance(value, float) and math.isnan(value):
                return "must be a number, not NaN"
            if self.finite and isinstance(value, float) and math.isinf(value):
                return "must be finite"
            for bound, ok in (
                (self.ge, lambda b: value >= b),
                (self.gt, lambda b: value > b),
                (self.le, lambda b: value <= b),
                (self.lt, lambda b: value < b),
            ):
                if bound is not None and not ok(bound):
                    return f"must be {self.describe().removeprefix('finite, ')}"
            return None
        if isinstance(value, str):
            if hasattr(self.choices, "resolve_error"):  # a registry (megatron_kl.registry): names and module:ATTR
                return self.choices.resolve_error(value)
            if self.choices is not None and value not in self.choices:
                return f"must be one of {list(self.choices)}"
            if (self.nonempty or self.path is not None) and not value.strip():
                return "must not be empty"
            if self.path is not None and _CHECK_PATHS.get():
                return _path_violation(value, self.path)
        if self.choices is not None and isinstance(value, (list, tuple)):
            bad = [v for v in value if v not in self.choices]
            if bad:
                return f"{bad} not among {list(self.choices)}"
        return None


def _number(value: float) -> str:
    """A bound as written: integers in full (a seed's 4294967295), others in %g."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


def _path_violation(value: str, kind: str) -> Optional[str]:
    if "{" in value:  # a template filled in later (train.output_dir's {run_name}): its existing part is checked
        value = value.split("{", 1)[0] or "."
    path = Path(os.path.expanduser(value))
    if kind == "file":
        return None if path.is_file() else f"names no file ({path.resolve()})"
    if kind == "dir":
        return None if path.is_dir() else f"names no directory ({path.resolve()})"
    existing = path  # writable: the deepest existing ancestor must be a writable directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be a directory: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable here ({existing} does not allow this user to write)"
    return None


RESUMABLE = "megatron_kl.resumable"
DERIVED = "megatron_kl.derived"  # a field resolved when a config is loaded, never given in YAML


def checked(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    resumable: bool = False,
    **constraint,
) -> Any:
    """A dataclass field carrying its :class:`Constraint` (keyword arguments as Constraint's). ``resumable``: the
    field may change between the starts of one run without changing what it computes (where outputs go, how they
    are logged, timeouts, where servers are; on a section: every field in it) - it is not part of the run's
    identity (run/identity_fields.py derives the list from these marks)."""
    metadata: dict = {KEY: Constraint(**constraint)} if constraint or not resumable else {}
    if resumable:
        metadata[RESUMABLE] = True
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def constraint_of(field: dataclasses.Field) -> Optional[Constraint]:
    return field.metadata.get(KEY)


def resumable_paths(cls, prefix: str = "") -> list[str]:
    """The dotted paths of ``cls``'s fields marked ``resumable`` (a marked section as ``section.``), nested sections
    walked."""
    hints = typing.get_type_hints(cls)
    out = []
    for item in dataclasses.fields(cls):
        hint = hints[item.name]
        section = dataclasses.is_dataclass(hint)
        if item.metadata.get(RESUMABLE):
            out.append(f"{prefix}{item.name}" + ("." if section else ""))
        elif section:
            out.extend(resumable_paths(hint, f"{prefix}{item.name}."))
    return out


def check_declared(obj, prefix: Optional[str] = None) -> None:
    """Each field's declared constraint on a dataclass built in Python (``KLConfig(estimator="k5")``): the same
    rule ``from_dict`` applies to YAML, so a library dataclass's ``__post_init__`` holds only its cross-field rules.
    Raises ConfigError naming ``prefix + field`` (default ``Class.``: ``from_dict`` has checked YAML values already,
    so this names a value given in Python). Paths are not checked here (they are where a config is loaded for this
    machine)."""
    prefix = f"{type(obj).__name__}." if prefix is None else prefix
    for item in dataclasses.fields(obj):
        rule = constraint_of(item)
        if rule is None:
            continue
        value = getattr(obj, item.name)
        if rule.path is not None:
            continue
        why = rule.violation(value)
        if why:
            shown = repr(value) if isinstance(value, str) else value
            raise ConfigError(f"{prefix}{item.name}={shown} {why}" + (f"; {rule.fix}" if rule.fix else ""))
