"""Reward functions by name: the built-ins, functions registered from Python, import paths and files.

``reward.functions[i].name`` is looked up in this order: a name registered with :func:`register` (from Python, before
the trainer is built), a built-in (``builtin.py``), ``package.module:function`` (imported), ``path/to/file.py:function``
(loaded from the file; a relative path is taken from the working directory). A name that resolves to nothing, a
function whose signature does not take the configured ``kwargs``, or an invalid built-in argument is a ConfigError at
start naming ``reward.functions[i]``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_kl.config import ConfigError
from megatron_kl.rewards import builtin
from megatron_kl.rewards.config import RewardConfig, RewardFunctionConfig
from megatron_kl.rewards.types import RewardInput

BUILTINS = ("arithmetic", "math_verify", "exact_match", "boxed_match", "regex_match", "service")
_REGISTERED: dict[str, tuple[Callable, str]] = {}


def register(name: str, function: Optional[Callable] = None, *, mode: str = "sample"):
    """Make ``function`` available as ``reward.functions[i].name: <name>`` (usable as a decorator). ``mode``:
    ``sample`` (called per response) or ``batch`` (called with the step's list of responses). A config entry's own
    ``mode`` must agree."""
    if mode not in ("sample", "batch"):
        raise ValueError(f"mode={mode!r}: use 'sample' or 'batch'")
    if name in BUILTINS:
        raise ValueError(f"{name!r} is a built-in reward; register yours under another name")

    def add(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"register({name!r}): {fn!r} is not callable")
        _REGISTERED[name] = (fn, mode)
        return fn

    return add(function) if function is not None else add


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


@dataclass(frozen=True)
class BoundReward:
    """A configured reward function ready to call: ``call(sample)`` (sample mode) or ``call(samples)`` (batch)."""

    label: str
    weight: float
    mode: str
    call: Callable[[Any], Any]
    where: str  # reward.functions[i] (name): for errors
    close: Callable[[], None] = lambda: None
    own_deadline: bool = False  # bounded by its own deadlines (the service's retry policy), not reward.timeout_s


def bind_all(cfg: RewardConfig, functions: list[RewardFunctionConfig], tokenizer) -> list[BoundReward]:
    return [bind(f, f"reward.functions[{i}]", cfg, tokenizer) for i, f in enumerate(functions)]


def bind(entry: RewardFunctionConfig, where: str, cfg: RewardConfig, tokenizer) -> BoundReward:
    where = f"{where} ({entry.name})"
    kwargs = dict(entry.kwargs)
    if entry.name in _REGISTERED:
        fn, mode = _REGISTERED[entry.name]
        if entry.mode not in ("auto", mode):
            raise ConfigError(f"{where}: registered with mode={mode}; set {where.split(' ')[0]}.mode={mode}")
    elif entry.name in BUILTINS:
        fn, mode, kwargs = _builtin(entry, where, cfg, tokenizer)
        if entry.name == "service":
            return BoundReward(entry.metric_label, entry.weight, "batch", fn, where, close=fn.close, own_deadline=True)
    else:
        fn, mode = _import(entry.name, where), "sample" if entry.mode == "auto" else entry.mode
    _check_signature(fn, kwargs, mode, where)
    call = (lambda x, _fn=fn, _kw=kwargs: _fn(x, **_kw)) if kwargs else fn
    return BoundReward(entry.metric_label, entry.weight, mode, call, where)


def _builtin(entry: RewardFunctionConfig, where: str, cfg: RewardConfig, tokenizer):
    name, kwargs = entry.name, dict(entry.kwargs)
    if entry.mode not in ("auto", "batch" if name == "service" else "sample"):
        raise ConfigError(
            f"{where}: the built-in {name} is called in mode={'batch' if name == 'service' else 'sample'}"
            "; leave mode at auto"
        )
    allowed = {
        "arithmetic": set(),
        "math_verify": set(),
        "exact_match": {"ignore_case"},
        "boxed_match": {"ignore_case"},
        "regex_match": {"pattern", "ignore_case"},
        "service": set(),
    }[name]
    unknown = set(kwargs) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown kwargs {sorted(unknown)}; {name} takes {sorted(allowed) or 'none'}")
    if name == "arithmetic":
        return builtin.make_arithmetic(tokenizer), "sample", {}
    if name == "math_verify":
        return builtin.math_verify, "sample", {}
    if name == "regex_match":
        if not isinstance(kwargs.get("pattern"), str) or not kwargs["pattern"]:
            raise ConfigError(f"{where}: regex_match needs kwargs.pattern, e.g. kwargs: {{pattern: 'answer: (\\S+)'}}")
        try:
            return builtin.make_regex_match(**kwargs), "sample", {}
        except ValueError as err:
            raise ConfigError(f"{where}.kwargs.pattern: {err}") from None
    if name == "service":
        from megatron_kl.rewards.service import RewardService

        return RewardService(cfg.service), "batch", {}
    return getattr(builtin, name), "sample", kwargs


def _import(name: str, where: str) -> Callable:
    if ":" not in name:
        raise ConfigError(
            f"{where}: not a built-in ({', '.join(BUILTINS)}), a registered name, "
            "'package.module:function' or 'path/to/file.py:function'"
        )
    target, attribute = name.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(f"{where}: the file {path.resolve()} does not exist")
        module_name = "megatron_kl_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's module: say which file failed and how
            raise ConfigError(f"{where}: loading {path} failed: {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ConfigError(
                f"{where}: cannot import {target} ({err}); install the package or give a file path "
                "'path/to/file.py:function'"
            ) from None
    fn = getattr(module, attribute, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{where}: {target} has no function {attribute!r}")
    return fn


def _check_signature(fn: Callable, kwargs: dict, mode: str, where: str) -> None:
    """The function must accept one positional argument (the sample, or the list) and the configured kwargs."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: called as configured
        return
    probe: Any = [] if mode == "batch" else RewardInput("", "", "", (), ())
    try:
        signature.bind(probe, **kwargs)
    except TypeError as err:
        raise ConfigError(
            f"{where}: the function {getattr(fn, '__name__', fn)}{signature} cannot be called as "
            f"fn({'samples' if mode == 'batch' else 'sample'}" + "".join(f", {k}=..." for k in kwargs) + f"): {err}"
        ) from None
