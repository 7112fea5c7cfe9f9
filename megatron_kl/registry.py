"""Named extension points: one :class:`Registry` per kind of thing a user may add (rollout engines, KL estimators,
model families, tasks), each entry a typed spec.

A registry is what a config field's ``choices`` are (``checked(..., choices=ENGINES)``), so a registered name is
accepted wherever a built-in one is, and ``config show`` lists every name known. An entry gets in two ways:

- ``REGISTRY.register(spec)`` from Python, before the config is loaded (a notebook, a launcher script);
- a config value ``package.module:ATTR`` (or ``path/to/file.py:ATTR``): the module is imported where the config is
  checked - on every rank, in every process - and its attribute, a spec of the registry's type, is registered under
  that value. This is the way for jobs whose ranks are separate processes (torchrun, Slurm).

The built-in entries live in the module named by ``builtins``, imported on the first lookup (so declaring the
registry beside a config field costs nothing, and its built-ins may depend on heavier layers). This module imports
nothing of the package.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Callable, Generic, Iterator, Optional, TypeVar

from megatron_kl.constraints import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Specs of one kind by name. ``kind``: what an entry is, in words ("rollout engine"); ``spec_type``: the class
    every entry is an instance of; ``builtins``: the module that registers the built-in entries."""

    def __init__(self, kind: str, spec_type: type, builtins: Optional[str] = None):
        self.kind, self.spec_type, self.builtins = kind, spec_type, builtins
        self._entries: dict[str, T] = {}  # registered names: the choices listed
        self._references: dict[str, T] = {}  # ``module:ATTR`` values loaded (accepted, not listed)
        self._loaded = builtins is None
        self._lock = threading.RLock()

    # -- adding and removing -------------------------------------------------------------------------------------
    def register(self, spec: T, *, name: Optional[str] = None, replace: bool = False) -> T:
        """Add ``spec`` under ``name`` (default: ``spec.name``); a name already taken is refused unless ``replace``."""
        if not isinstance(spec, self.spec_type):
            raise TypeError(f"a {self.kind} is registered as a {self.spec_type.__name__}, not {type(spec).__name__}")
        name = name or spec.name
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name")
        with self._lock:
            self._load_builtins()
            if name in self._entries and not replace and self._entries[name] is not spec:
                raise ValueError(f"{self.kind} {name!r} is registered already; pick another name or pass replace=True")
            self._entries[name] = spec
        return spec

    def unregister(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)
            self._references.pop(name, None)

    # -- looking up ----------------------------------------------------------------------------------------------
    def get(self, name: str, field: str = "") -> T:
        """The spec registered as ``name``, importing ``module:ATTR`` names; a ConfigError naming ``field`` else."""
        error = self.resolve_error(name)
        if error is not None:
            raise ConfigError(f"{field or self.kind}={name!r} {error}")
        return self._entries[name] if name in self._entries else self._references[name]

    def resolve_error(self, name) -> Optional[str]:
        """Why ``name`` names no entry (None: it does, now registered)."""
        with self._lock:
            self._load_builtins()
            if not isinstance(name, str):
                return f"must be a name, not {type(name).__name__}"
            if name in self._entries or name in self._references:
                return None
            if ":" not in name:
                return (
                    f"must be one of {self.names()} (a registered {self.kind}), or 'package.module:ATTR' / "
                    f"'path/to/file.py:ATTR' naming a {self.spec_type.__name__}"
                )
            try:
                spec = _load_attribute(name)
            except Exception as err:  # noqa: BLE001 - any failure of a user's module is reported by name
                return f"cannot load it: {type(err).__name__}: {err}"
            if not isinstance(spec, self.spec_type):
                return f"names a {type(spec).__name__}, not a {self.spec_type.__name__} ({self.kind})"
            self._references[name] = spec
            return None

    def names(self) -> list[str]:
        with self._lock:
            self._load_builtins()
            return list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        with self._lock:
            self._load_builtins()
            return list(self._entries.items())

    def where(self, predicate: Callable[[T], bool]) -> list[str]:
        """The names of the entries ``predicate`` holds for (``ENGINES.where(lambda e: e.reports_routing)``)."""
        return [name for name, spec in self.items() if predicate(spec)]

    # a registry is a config field's ``choices``: membership, iteration and a printable form
    def __contains__(self, name) -> bool:
        return self.resolve_error(name) is None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries) if self._loaded else '...'})"

    def and_names(self, *extra: str) -> "Choices":
        """This registry's names and ``extra`` ones (``kl.estimator``'s ``auto``) as one field's ``choices``."""
        return Choices(self, extra)

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True  # before the import: the module registers through register()
            try:
                importlib.import_module(self.builtins)
            except BaseException:
                self._loaded = False
                raise


def _load_attribute(reference: str):
    """``package.module:ATTR`` or ``path/to/file.py:ATTR`` -> the attribute (the module imported once)."""
    module_name, _, attr = reference.rpartition(":")
    if not module_name or not attr:
        raise ValueError("expected 'package.module:ATTR' or 'path/to/file.py:ATTR'")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        key = "megatron_kl_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:16]
        module = sys.modules.get(key)
        if module is None:
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(key, None)
                raise
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise AttributeError(f"module {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


class Choices:
    """A registry's names plus fixed ones that are not entries (a mode such as ``auto``): a field's ``choices``."""

    def __init__(self, registry: Registry, extra: tuple[str, ...]):
        self.registry, self.extra = registry, tuple(extra)

    def resolve_error(self, name) -> Optional[str]:
        if name in self.extra:
            return None
        error = self.registry.resolve_error(name)
        if error is not None and ":" not in str(name):
            return (
                f"must be one of {list(self)} (a registered {self.registry.kind}), or 'package.module:ATTR' / "
                f"'path/to/file.py:ATTR' naming a {self.registry.spec_type.__name__}"
            )
        return error

    def __contains__(self, name) -> bool:
        return self.resolve_error(name) is None

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry.names() + list(self.extra))

    def __len__(self) -> int:
        return len(self.registry) + len(self.extra)
