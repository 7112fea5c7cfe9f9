"""Per-step metrics to JSONL (always), TensorBoard and W&B (when configured), and a rich progress bar.

Only the logging rank (``enabled=True``) writes. On resume the JSONL is truncated to the checkpointed step,
so the file of a resumed run reads exactly like the uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

from megatron_kl.train.metric_registry import canonical_record

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, wandb_project: Optional[str] = None,
                 run_name: str = "", config: Optional[dict] = None, progress: bool = True, total_steps: int = 0,
                 resume_step: int = 0):
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
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(self.run_dir),
                                     resume="allow")
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[status]}"), transient=False)
            self._task = self._progress.add_task(run_name or "train", total=total_steps, completed=resume_step,
                                                 status="")
            self._progress.start()

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
                log.warning("%s line %d is not a JSON record (a write cut short?): dropped on resume", self.jsonl, number)
                continue
            if record.get("step", -1) < step:
                keep.append(line)
        self.jsonl.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None)
                 for k, v in metrics.items()}
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
        if self._progress is None:
            return
        status = " ".join(f"{k.split('/')[-1]}={metrics[k]:.3f}" for k in ("reward/mean", "kl/exact_token")
                          if k in metrics)
        if metrics.get("reward/failed"):  # samples excluded for a failed reward call (reward.on_failure=exclude)
            status += f" reward_failed={metrics['reward/failed']:g}"
        self._progress.update(self._task, completed=step, status=status)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, every key under its current name (older runs' spellings are
    renamed: train/metric_registry.py)."""
    return [canonical_record(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
