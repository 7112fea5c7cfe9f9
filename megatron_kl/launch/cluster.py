"""A cluster as the launch recipes (top-level ``launch/clusters.py``) describe it: which NeMo-Run executor, the
``launch:`` settings that make a job fit the machine, and an optional hook that edits the NeMo-Run executor
itself for what the settings do not cover.

Precedence: the training/study YAML's ``launch:`` section < the cluster's settings < command-line overrides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Optional

from megatron_kl.config import ConfigError

EXECUTORS = ("local", "slurm")


@dataclass
class Cluster:
    executor: str  # "local": torchrun on this machine; "slurm": sbatch through NeMo-Run's SlurmExecutor
    launch: dict = field(default_factory=dict)  # the launch: section, YAML shape ({"slurm": {"account": ...}})
    customize: Optional[Callable[[object], None]] = None  # called with every NeMo-Run executor built for a task
    description: str = ""

    def __post_init__(self):
        if self.executor not in EXECUTORS:
            raise ConfigError(f"Cluster.executor={self.executor!r}: use one of {list(EXECUTORS)}")
        if not isinstance(self.launch, dict):
            raise ConfigError(f"Cluster.launch must be a mapping (the launch: section), got {self.launch!r}")

    def overrides(self) -> list[str]:
        """The settings as dotted ``launch.*`` overrides (values as JSON, which YAML reads back unchanged); nested
        mappings merge key by key into the YAML's (an ``env`` entry adds one variable)."""
        out: list[str] = []

        def walk(prefix: str, value) -> None:
            if isinstance(value, dict) and value:
                for key, sub in value.items():
                    walk(f"{prefix}.{key}", sub)
            else:
                out.append(f"{prefix}={json.dumps(value)}")

        walk("launch", self.launch)
        return out
