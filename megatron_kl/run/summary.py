"""What a finished training run reports: :class:`RunSummary` (``train()``'s return value, ``summary.json``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


@dataclass(frozen=True)
class RunSummary:
    """A run's name and id, its configured steps, where its outputs are, and the evaluation before and after training
    (``eval/*`` keys; empty when the logging rank did not read them). ``already_finished``: nothing was trained, the
    output directory held this run finished (its summary as written then)."""

    run_name: str
    run_id: str
    steps: int
    run_dir: str
    metrics: str
    tensorboard: str
    plots: str
    eval_before: dict = field(default_factory=dict)
    eval_after: dict = field(default_factory=dict)
    already_finished: bool = False

    def to_json(self) -> dict:
        """``summary.json``'s mapping (the evaluations only where there are some; never already_finished)."""
        out = {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("eval_before", "eval_after", "already_finished")
        }
        if self.eval_before:
            out["eval_before"], out["eval_after"] = dict(self.eval_before), dict(self.eval_after)
        return out

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))


def read_summary(run_dir: Path, canonical: Callable[[dict], dict] = dict) -> Optional[RunSummary]:
    """The ``summary.json`` of ``run_dir`` (None when absent or unreadable); ``canonical`` renames the evaluations'
    keys (train/metric_registry.canonical_record: older runs' names to the current ones)."""
    try:
        data = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    names = {f.name for f in dataclasses.fields(RunSummary)} - {"already_finished"}
    values = {k: v for k, v in data.items() if k in names}
    for key in ("eval_before", "eval_after"):
        values[key] = canonical(values[key]) if isinstance(values.get(key), dict) else {}
    try:
        return RunSummary(**values)
    except TypeError:  # a field missing: not a summary this version reads
        return None
