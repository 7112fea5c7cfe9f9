"""The loader every config section shares: YAML (duplicate keys refused), dotted command-line overrides, and
``from_dict``, which builds nested frozen dataclasses from mappings and checks each value against its field's type
hint and declared constraint, naming the field on a mistake."""

from __future__ import annotations

import dataclasses
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

import yaml

from megatron_kl.constraints import DERIVED, ConfigError, constraint_of
from megatron_kl.redaction import redact_config


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin is not None and type(None) in get_args(hint):  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        inner = [a for a in get_args(hint) if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is list and get_args(hint) and get_args(hint)[0] in (str, int, float):
        if isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} must be a list, e.g. {where}=[a,b]")
        if not isinstance(value, (list, tuple)):
            value = [value]  # one item: `train_files: data.jsonl`, `logging.profile_steps=3`
        item = get_args(hint)[0]
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is list and get_args(hint) and is_dataclass(get_args(hint)[0]):  # a list of sections
        if isinstance(value, dict):
            value = [value]  # one item
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} must be a list of mappings, e.g. {where}=[{{name: x}}]")
        return [_coerce(v, get_args(hint)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # free-form keyword arguments (a reward function's): string keys, YAML values
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}={value!r} must be a mapping with string keys, e.g. {where}={{key: value}}")
        return dict(value)
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return from_dict(hint, value, prefix=where + ".")
    if value is None and hint in (bool, int, float, str):
        raise ConfigError(f"{where} must be set (null is not a {hint.__name__} here)")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}={value!r} must be true or false")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(
                f"{where}={str(value).lower()} must be a{'n integer' if hint is int else ' number'}, not true/false"
            )
        try:
            out = hint(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where}={value!r} must be a{'n int' if hint is int else ' float'}") from None
        if hint is int and isinstance(value, float) and value != out:
            raise ConfigError(f"{where}={value!r} must be an integer")
        return out
    if hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off / on (and no / yes) as false / true
            return "on" if value else "off"
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}={value!r} must be a string")
        return str(value)
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict; unknown keys are errors naming the key."""
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls) if f.init and not f.metadata.get(DERIVED)}  # resolved at load: not given
    unknown = set(data) - names
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {sorted(prefix + k for k in unknown)}; valid keys here: {sorted(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    for item in fields(cls):
        rule = constraint_of(item)
        if rule is not None and item.name in kwargs:
            why = rule.violation(kwargs[item.name])
            if why:
                value = kwargs[item.name] if isinstance(kwargs[item.name], (int, float)) else data[item.name]
                raise ConfigError(f"{prefix}{item.name}={_shown(value)} {why}" + (f"; {rule.fix}" if rule.fix else ""))
    try:
        built = cls(**kwargs)
        resolve = getattr(cls, "__resolve__", None)  # the loader's step after construction (TrainConfig's)
        return resolve(built) if resolve is not None else built
    except ConfigError:
        raise
    except ValueError as err:  # a library dataclass (KLConfig, RPGConfig...) names itself: say the YAML path
        message = str(err)
        for klass in cls.__mro__:  # a subclass's error may come from its base (DistillObjective: KLConfig's rules)
            message = message.replace(f"{klass.__name__}.", prefix)
        raise ConfigError(message) from None


def _shown(value) -> str:
    """A value as the user typed it (YAML spelling for true/false/null)."""
    if value is None or isinstance(value, bool):
        return yaml.safe_dump(value).split("\n")[0]
    return repr(value) if isinstance(value, str) else str(value)


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def redact_secrets(data: dict) -> dict:
    """A copy of a config dict (``to_dict``) for files, trackers and printing (config.yaml, run.json, W&B,
    ``--check``): secret fields and environment entries (``launch.env``), secret flags' values in argument lists and
    known secrets anywhere replaced (``megatron_kl.redaction``)."""
    return redact_config(data)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings (value parsed as YAML) onto a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = parse_yaml(raw, f"override {item!r}")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} is given twice (lines {seen[key] + 1} and "
                        f"{key_node.start_mark.line + 1}): keep one",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
            except TypeError:  # an unhashable key: PyYAML's own error follows
                pass
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str):
    """``yaml.safe_load`` (keys given twice refused) with a one-line ConfigError naming ``where`` and the position
    instead of a traceback."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML{at}: {problem}") from None


def read_yaml_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    data = parse_yaml(text, f"config file {path}") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not a {type(data).__name__}")
    return data


def load_yaml(path: str | Path, cls, overrides: Optional[list[str]] = None):
    return from_dict(cls, apply_overrides(read_yaml_file(path), overrides or []))
