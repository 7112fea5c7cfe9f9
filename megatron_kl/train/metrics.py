"""Per-step metrics to JSONL (always), TensorBoard and W&B (when configured), and the progress (train/progress.py).

Only the logging rank (``enabled=True``) writes. On resume the JSONL is truncated to the checkpointed step,
so the file of a resumed run reads exactly like the uninterrupted run's.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Optional

from megatron_kl.train.metric_registry import canonical_record
from megatron_kl.train.progress import StepProgress

log = logging.getLogger(__name__)


def wandb_missing(project: Optional[str]) -> Optional[str]:
    """Why W&B logging cannot start (None: it can, or it is off)."""
    if not project:
        return None

    if importlib.util.find_spec("wandb") is None:
        return (
            f"logging.wandb_project={project!r} needs the wandb package, which is not installed: "
            "pip install 'megatron-kl[wandb]' (or unset logging.wandb_project)"
        )
    return None


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        tensorboard: bool = True,
        wandb: Optional[dict] = None,
        run_name: str = "",
        config: Optional[dict] = None,
        progress: bool = True,
        total_steps: int = 0,
        resume_step: int = 0,
        progress_every: int = 1,
        progress_every_s: float = 0.0,
    ):
        """``wandb``: ``wandb.init`` settings (project, entity, tags, mode, id), None for no W&B."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self._tb = self._wandb = self._progress = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate(resume_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed: metrics go to %s only (pip install tensorboard)", self.jsonl)
        if wandb:
            import wandb as wandb_module

            self._wandb = wandb_module.init(
                name=run_name, config=config, dir=str(self.run_dir), resume="allow", **wandb
            )
        self._done = resume_step
        if progress:
            self._progress = StepProgress(
                run_name or "train", total_steps, resume_step, progress_every, progress_every_s
            )

    def _truncate(self, step: int) -> None:
        """Drop records of steps >= ``step`` (written after the checkpoint we resume from)."""
        if not self.jsonl.is_file():
            return
        keep = []
        for number, line in enumerate(self.jsonl.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # e.g. the partial last line of a killed run
                log.warning(
                    "%s line %d is not a JSON record (a write cut short?): dropped on resume", self.jsonl, number
                )
                continue
            if record.get("step", -1) < step:
                keep.append(line)
        self.jsonl.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {
            k: (float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None)
            for k, v in metrics.items()
        }
        nonfinite = sorted(k for k, v in clean.items() if v is None)
        if nonfinite:  # written as null, never silently: counted in the record and warned about by name
            log.warning("step %d: non-finite metric value(s) logged as null: %s", step, ", ".join(nonfinite))
        clean["health/nonfinite_metrics"] = float(len(nonfinite))
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def advance(self, step: int, metrics: dict) -> None:
        """``step`` steps are finished, the last with ``metrics``."""
        self._done = step
        if self._progress is not None:
            self._progress.advance(step, metrics)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close(self._done)
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, every key under its current name (older runs' spellings are
    renamed: train/metric_registry.py)."""
    return [canonical_record(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
