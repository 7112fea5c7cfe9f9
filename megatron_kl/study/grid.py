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

Each run is ``<configuration>-seed<seed>``; its directory is ``output_dir/runs/<run>``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


from megatron_kl.config import ConfigError, read_yaml_file


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


def load_study(path, overrides: Optional[list[str]] = None) -> StudyConfig:
    data = read_yaml_file(path)
    unknown = set(data) - set(StudyConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"study config {path}: unknown key(s) {sorted(unknown)}; "
                          f"use {sorted(StudyConfig.__dataclass_fields__)}")
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
                        collapse_fraction=float(data.get("collapse_fraction", 0.5)))
    names = [c.name for c in study.configurations + _grid_configurations(study.grid)]
    if not names:
        raise ConfigError(f"study config {path}: give 'configurations' and/or a 'grid'")
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ConfigError(f"study config {path}: configuration names must be unique, repeated: {sorted(duplicates)}")
    return study


def expand(study: StudyConfig) -> list[RunSpec]:
    """Every (configuration, seed) run with its full override list; validated before anything runs."""
    from megatron_kl.train.config import load_train_config

    runs = []
    root = Path(study.output_dir) / "runs"
    for configuration in study.configurations + _grid_configurations(study.grid):
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
