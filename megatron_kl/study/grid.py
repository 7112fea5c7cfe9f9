"""Study config and its expansion into runs.

A study YAML names a base training config, overrides shared by every run, the configurations (each a
name and its dotted overrides; or a ``grid`` whose axes are crossed) and the seeds:

    name: cpu-estimators
    base: configs/cpu/default.yaml
    output_dir: runs/study-cpu
    seeds: [1, 2]
    common: [train.steps=40]
    configurations:
      - {name: k3-loss, overrides: [kl.estimator=k3, kl.placement=loss]}
    grid: {kl.estimator: [k1, k3], kl.placement: [reward, loss]}     # optional, crossed

Each run is ``<configuration>-seed<seed>``; its directory is ``output_dir/runs/<run>``. A study can start from
another (``extends: cpu.yaml``, relative to its own folder; its keys replace the other's), run a subset
(``only: ["async4-*"]``, name patterns) and name a published ``claims.json`` whose verdicts its report puts beside
its own (``published``). ``claim3_statistic`` declares which statistic decides the third claim.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_kl.config import ConfigError, from_dict, read_yaml_file
from megatron_kl.constraints import SEED_MAX, checked
from megatron_kl.study.claims import CLAIM3
from megatron_kl.train.config import load_train_config


@dataclass
class Configuration:
    name: str = checked("", free=True, nonempty=True)
    overrides: list[str] = field(default_factory=list)


@dataclass
class StudyConfig:
    """A study YAML, typed and checked like the training config (``megatron_kl.config.from_dict``)."""

    name: str = checked("", free=True, nonempty=True)
    base: str = checked("", path="file")  # the training YAML every run starts from
    output_dir: str = checked("", path="writable")
    seeds: list[int] = field(default_factory=lambda: [1])  # at least one, each once, 0 <= seed < 2^32
    common: list[str] = field(default_factory=list)
    configurations: list[Configuration] = field(default_factory=list)
    grid: dict[str, Any] = field(default_factory=dict)
    # an event: KL or grad norm above factor x its run median (> 1: the median itself is never an event)
    instability_factor: float = checked(10.0, gt=1)
    # unstable: final in-domain pass@1 below this x its first evaluation (0: off)
    collapse_fraction: float = checked(0.5, ge=0, le=1)
    # which statistic decides claim 3 (both are reported): "unstable" (any event or a collapse) or "collapsed"
    # (the severe kind alone: a spike that training recovers from is not counted)
    claim3_statistic: str = checked("unstable", choices=tuple(CLAIM3))
    only: list[str] = field(default_factory=list)  # run only the configurations whose names match (fnmatch)
    published: Optional[str] = checked(
        None, path="file"
    )  # a published claims.json whose verdicts the report puts beside these
    extends: Optional[str] = checked(
        None, free=True
    )  # the study YAML this one starts from (its keys, replaced by the ones here)
    # what the report must say before its verdicts (a preset too small to decide anything says so)
    caveat: Optional[str] = checked(None, free=True)
    # a score to reach (a distillation teacher's): the report says which configuration reached it first and by how
    # many steps (study/reach.py); null: no such section
    reach_target: Optional[float] = checked(None)
    reach_metric: str = checked("eval/id/pass@1", free=True, nonempty=True)

    def __post_init__(self):
        if not self.seeds:
            raise ConfigError("seeds=[] must list at least one seed, e.g. seeds: [1, 2, 3]")
        repeated = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if repeated:
            raise ConfigError(
                f"seeds={self.seeds} repeats {repeated}: each seed is one run per configuration; list each once"
            )
        out_of_range = [s for s in self.seeds if not 0 <= s <= SEED_MAX]
        if out_of_range:
            raise ConfigError(f"seeds={self.seeds}: {out_of_range} outside 0..{SEED_MAX} (the generators' range)")
        for key, values in self.grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid axis {key!r} must be a non-empty list of values, e.g. {key}: [a, b]")
        if self.caveat:
            self.caveat = " ".join(self.caveat.split())


@dataclass
class RunSpec:
    configuration: str
    seed: int
    overrides: list[str]
    output_dir: Path

    @property
    def name(self) -> str:
        return f"{self.configuration}-seed{self.seed}"


def _grid_configurations(grid: dict) -> list[Configuration]:
    if not grid:
        return []
    axes = list(grid.items())
    for key, values in axes:
        if not isinstance(values, list) or not values:
            raise ConfigError(f"study grid axis {key!r} must be a non-empty list of values")
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        overrides = [f"{key}={value}" for (key, _), value in zip(axes, combo)]
        out.append(Configuration("-".join(str(v) for v in combo), overrides))
    return out


def _beside(path, relative: str) -> str:
    """``relative`` as written in the study file ``path``: relative to that file's folder, else as given."""
    candidate = Path(path).parent / relative
    return str(candidate) if candidate.exists() else relative


def _read(path, seen: tuple = ()) -> dict:
    """The study file's keys over those of the file it ``extends`` (recursively)."""
    data = read_yaml_file(path)
    unknown = set(data) - set(StudyConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(
            f"study config {path}: unknown key(s) {sorted(unknown)}; use {sorted(StudyConfig.__dataclass_fields__)}"
        )
    if data.get("published"):
        data["published"] = _beside(path, str(data["published"]))
    if not data.get("extends"):
        return data
    parent = _beside(path, str(data["extends"]))
    if not Path(parent).is_file():
        raise ConfigError(
            f"study config {path}: extends={data['extends']} is not a file (relative to {Path(path).parent})"
        )
    if Path(parent).resolve() in seen:
        raise ConfigError(f"study config {path}: extends={data['extends']} makes a cycle")
    return {**_read(parent, seen + (Path(path).resolve(),)), **data}


def load_study(path, overrides: Optional[list[str]] = None) -> StudyConfig:
    data = _read(path)
    for key in ("name", "base", "output_dir"):
        if not data.get(key):
            raise ConfigError(f"study config {path}: '{key}' is required")
    for i, item in enumerate(data.get("configurations") or []):
        if not isinstance(item, dict) or "name" not in item:
            raise ConfigError(f"study config {path}: configurations[{i}] needs a 'name' (and 'overrides')")
    for key in ("configurations", "grid", "common", "only"):  # an empty YAML key (``grid:``) is the default
        if key in data and data[key] is None:
            del data[key]
    if "seeds" in data and data["seeds"] is None:
        data["seeds"] = []  # ``seeds:`` with nothing: refused as no seeds
    try:
        study = from_dict(StudyConfig, data)
    except ConfigError as err:
        raise ConfigError(f"study config {path}: {err}") from None
    study.common = study.common + list(overrides or [])
    names = [c.name for c in _every(study)]
    if not names:
        raise ConfigError(f"study config {path}: give 'configurations' and/or a 'grid'")
    unmatched = [p for p in study.only if not any(_matches(n, [p]) for n in names)]
    if unmatched:
        raise ConfigError(f"study config {path}: only={unmatched} matches no configuration; names: {names}")
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ConfigError(f"study config {path}: configuration names must be unique, repeated: {sorted(duplicates)}")
    return study


def _every(study: StudyConfig) -> list[Configuration]:
    return study.configurations + _grid_configurations(study.grid)


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def selected(study: StudyConfig) -> list[Configuration]:
    """The configurations this study runs: all, or those whose names match a pattern of ``only``."""
    return [c for c in _every(study) if not study.only or _matches(c.name, study.only)]


def expand(study: StudyConfig) -> list[RunSpec]:
    """Every (configuration, seed) run with its full override list; validated before anything runs."""
    runs = []
    root = Path(study.output_dir) / "runs"
    for configuration in selected(study):
        for seed in study.seeds:
            spec = RunSpec(configuration.name, seed, [], root / f"{configuration.name}-seed{seed}")
            spec.overrides = [
                *study.common,
                *configuration.overrides,
                f"train.seed={seed}",
                f"train.output_dir={spec.output_dir}",
            ]
            try:
                load_train_config(study.base, spec.overrides)
            except (ConfigError, ValueError) as err:
                raise ConfigError(f"study run {spec.name}: {err}") from None
            runs.append(spec)
    return runs
