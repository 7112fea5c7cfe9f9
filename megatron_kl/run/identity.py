"""A run's identity: what decides its trajectory, recorded in every checkpoint and compared on resume.

The identity is the resolved configuration, flattened to dotted YAML paths (``kl.coef``), plus the world size
and the SHA-256 of the task's data files and of the warm-start checkpoint file, minus the fields declared resumable (identity_fields.resumable_prefixes): the
fields that may change between the starts of one run without changing what it computes. A resume whose
identity differs from the checkpoint's is refused naming every differing field (old -> new);
``train.steps`` may grow (the learning-rate schedule is set by ``optim.decay_steps``, not by it), never drop
below the checkpointed step.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from megatron_kl.config import to_dict
from megatron_kl.redaction import redact_config
from megatron_kl.run import identity_fields as fields
from megatron_kl.run.identity_fields import DERIVED, flatten  # noqa: F401
from megatron_kl.run.manifest import sha256_of


def _file_digests(cfg) -> dict[str, str]:
    """SHA-256 of the files whose content (not only path) decides the run."""
    paths = []
    if cfg.task.name == "math":
        paths += [*cfg.task.math.train_files, *cfg.task.math.eval_files, *cfg.task.math.ood_files]
    if cfg.task.name == "dataset":
        paths += [*cfg.task.dataset.train_files, *cfg.task.dataset.eval_files, *cfg.task.dataset.ood_files]
    paths += [f.name.rsplit(":", 1)[0] for f in cfg.reward.functions if f.name.rsplit(":", 1)[0].endswith(".py")]
    if cfg.warm_start.checkpoint:
        paths.append(cfg.warm_start.checkpoint)
    if cfg.init.hf_checkpoint:
        paths.append(str(Path(cfg.init.hf_checkpoint) / "config.json"))
    teacher = cfg.distill.teacher
    if cfg.distill.enabled and teacher.source == "checkpoint":
        paths.append(teacher.checkpoint)
    if cfg.distill.enabled and teacher.source == "hf":
        paths.append(str(Path(teacher.hf_checkpoint) / "config.json"))
    digests = {}
    for path in paths:
        if Path(path).is_file():
            digests[f"file:{path}"] = sha256_of(Path(path))
    return digests


@functools.lru_cache(maxsize=None)
def _default_identity(config_type) -> dict:
    """The default configuration's identity fields (JSON-safe) of a config type."""
    prefixes = fields.resumable_prefixes(config_type)
    defaults = fields.identity_fields(redact_config(to_dict(config_type())), prefixes)
    return json.loads(json.dumps(defaults, default=str))


def _identity_fields(cfg) -> dict[str, Any]:
    """The identity's fields, secrets redacted (a key is not what a run computes: a rotated key resumes, and
    run.json, written with each checkpoint, never holds one)."""
    return fields.identity_fields(redact_config(to_dict(cfg)), fields.resumable_prefixes(type(cfg)))


def identity_of(cfg, world_size: int) -> dict[str, Any]:
    """The run's identity (JSON-safe: tuples become lists as they would in the checkpoint's file)."""
    values = _identity_fields(cfg)
    values["world_size"] = world_size
    values.update(_file_digests(cfg))
    return json.loads(json.dumps(values, default=str))


def differences(recorded: dict, current: dict, config_type) -> list[str]:
    """``field: old -> new`` for every identity field that differs (removed fields included). A field the checkpoint
    does not record - one a later version of megatron-kl added - differs only when it is set to other than its
    default in ``config_type`` (TrainConfig): a new option's default is the behaviour the run had before it
    existed."""
    missing = object()
    defaults = _default_identity(config_type)
    out = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key, missing), current.get(key, missing)
        if old is missing and new is not missing:
            if key in defaults and defaults[key] == new:
                continue
        if old != new:
            show = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            out.append(f"{key}: {show(old)} -> {show(new)}")
    return out


def changed_resumable(recorded_config: dict, current_config: dict, config_type) -> dict[str, list]:
    """The allowed fields a resume changes (for the start history)."""
    prefixes = fields.resumable_prefixes(config_type)
    old, new = flatten(recorded_config), flatten(current_config)
    return {
        k: [old.get(k), new.get(k)]
        for k in sorted(set(old) | set(new))
        if fields.resumable(k, prefixes) and old.get(k) != new.get(k)
    }
