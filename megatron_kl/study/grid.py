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
from typing import Optional


from megatron_kl.config import ConfigError, read_yaml_file
from megatron_kl.study.claims import CLAIM3


@dataclass
class Configuration:
    name: str
    overrides: list[str] = field(default_factory=list)


@dataclass
class StudyConfig:
    name: str
    base: str
    output_dir: str
    seeds: list[int] = field(default_factory=lambda: [1])
    common: list[str] = field(default_factory=list)
    configurations: list[Configuration] = field(default_factory=list)
    grid: dict = field(default_factory=dict)
    instability_factor: float = 10.0  # an event: KL or grad norm above factor x its run median
    collapse_fraction: float = 0.5  # unstable: final in-domain pass@1 below this x its first evaluation (0: off)
    # which statistic decides claim 3 (both are reported): "unstable" (any event or a collapse) or "collapsed"
    # (the severe kind alone: a spike that training recovers from is not counted)
    claim3_statistic: str = "unstable"
    only: list[str] = field(default_factory=list)  # run only the configurations whose names match (fnmatch)
    published: Optional[str] = None  # a published claims.json whose verdicts the report puts beside these
    extends: Optional[str] = None  # the study YAML this one starts from (its keys, replaced by the ones here)
    # what the report must say before its verdicts (a preset too small to decide anything says so)
    caveat: Optional[str] = None


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
        raise ConfigError(f"study config {path}: unknown key(s) {sorted(unknown)}; "
                          f"use {sorted(StudyConfig.__dataclass_fields__)}")
    if data.get("published"):
        data["published"] = _beside(path, str(data["published"]))
    if not data.get("extends"):
        return data
    parent = _beside(path, str(data["extends"]))
    if not Path(parent).is_file():
        raise ConfigError(f"study config {path}: extends={data['extends']} is not a file (relative to {Path(path).parent})")
    if Path(parent).resolve() in seen:
        raise ConfigError(f"study config {path}: extends={data['extends']} makes a cycle")
    return {**_read(parent, seen + (Path(path).resolve(),)), **data}


def load_study(path, overrides: Optional[list[str]] = None) -> StudyConfig:
    data = _read(path)
    for key in ("name", "base", "output_dir"):
        if not data.get(key):
            raise ConfigError(f"study config {path}: '{key}' is required")
    configs = []
    for i, item in enumerate(data.get("configurations") or []):
        if not isinstance(item, dict) or "name" not in item:
            raise ConfigError(f"study config {path}: configurations[{i}] needs a 'name' (and 'overrides')")
        configs.append(Configuration(str(item["name"]), [str(o) for o in item.get("overrides") or []]))
    study = StudyConfig(name=data["name"], base=data["base"], output_dir=data["output_dir"],
                        seeds=[int(s) for s in data.get("seeds") or [1]],
                        common=[str(o) for o in data.get("common") or []] + list(overrides or []),
                        configurations=configs, grid=data.get("grid") or {},
                        instability_factor=float(data.get("instability_factor", 10.0)),
                        collapse_fraction=float(data.get("collapse_fraction", 0.5)),
                        claim3_statistic=str(data.get("claim3_statistic", "unstable")),
                        only=[str(p) for p in data.get("only") or []], published=data.get("published"),
                        extends=data.get("extends"),
                        caveat=" ".join(str(data["caveat"]).split()) if data.get("caveat") else None)
    if study.claim3_statistic not in CLAIM3:
        raise ConfigError(f"study config {path}: claim3_statistic={study.claim3_statistic!r}; use one of "
                          f"{list(CLAIM3)}")
    if study.published and not Path(study.published).is_file():
        raise ConfigError(f"study config {path}: published={study.published} is not a file (a claims.json)")
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
    from megatron_kl.train.config import load_train_config

    runs = []
    root = Path(study.output_dir) / "runs"
    for configuration in selected(study):
        for seed in study.seeds:
            spec = RunSpec(configuration.name, seed, [], root / f"{configuration.name}-seed{seed}")
            spec.overrides = [*study.common, *configuration.overrides, f"train.seed={seed}",
                              f"train.output_dir={spec.output_dir}"]
            try:
                load_train_config(study.base, spec.overrides)
            except (ConfigError, ValueError) as err:
                raise ConfigError(f"study run {spec.name}: {err}") from None
            runs.append(spec)
    return runs
