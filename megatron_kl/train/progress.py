"""What a run shows while it trains, on the logging rank only: a progress bar on a terminal, plain lines elsewhere.

On a terminal (rich's console is one) a single bar that fits 80 columns: the run's name (cut to fit), the bar, the
step count, elapsed and remaining time, and the step's reward and KL labelled. Anywhere else - a Slurm log, a file, a
pipe - one plain log line every ``logging.progress_every`` steps (and at least every ``logging.progress_every_s``
seconds when that is set), with step/total, the reward, every KL term logged, the step's seconds, tokens/s and the
time remaining. At the end one line with the total wall time of the steps this start trained.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger("megatron_kl.train")

KL_KEYS = ("kl/exact_token", "kl/k1_token", "kl/k3_token")
DISTILL_KEYS = ("distill/exact_token", "distill/k1_token")  # the KL to the teacher (distillation): the first logged
NAME_WIDTH = 18


def clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def step_values(metrics: dict) -> str:
    """``reward 0.853 kl/exact 1.2e-03 ...``: the step's reward and KL terms, labelled."""
    parts = [f"reward {metrics['reward/mean']:.3f}"] if metrics.get("reward/mean") is not None else []
    parts += [f"{key.removesuffix('_token')} {metrics[key]:.2e}" for key in KL_KEYS if metrics.get(key) is not None]
    teacher = next((key for key in DISTILL_KEYS if metrics.get(key) is not None), None)
    if teacher is not None:
        parts.append(f"{teacher.removesuffix('_token')} {metrics[teacher]:.2e}")
    if metrics.get("reward/failed"):
        parts.append(f"reward_failed {metrics['reward/failed']:g}")
    return " ".join(parts)


def bar_values(metrics: dict) -> str:
    """The bar's short form: the reward and the first KL term logged (exact, else k1, else k3)."""
    parts = [f"reward {metrics['reward/mean']:.3f}"] if metrics.get("reward/mean") is not None else []
    kl = next((metrics[key] for key in KL_KEYS if metrics.get(key) is not None), None)
    if kl is not None:
        parts.append(f"kl {kl:.1e}")
    teacher = next((metrics[key] for key in DISTILL_KEYS if metrics.get(key) is not None), None)
    if teacher is not None:
        parts.append(f"teacher {teacher:.1e}")
    if metrics.get("reward/failed"):
        parts.append(f"failed {metrics['reward/failed']:g}")
    return " ".join(parts)


class StepProgress:
    """The bar or the lines of one start of a run (``start_step`` .. ``total``)."""

    def __init__(self, name: str, total: int, start_step: int = 0, every: int = 1, every_s: float = 0.0, console=None):
        from rich.console import Console

        self.total, self.start_step, self.every, self.every_s = total, start_step, every, every_s
        self.console = console if console is not None else Console()
        self.started = time.monotonic()
        self._last_line = self.started
        self._bar = None
        if self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            short = name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "~"
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=10),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task(short, total=total, completed=start_step, status="")
            self._bar.start()

    def remaining_s(self, done: int) -> Optional[float]:
        trained = done - self.start_step
        if trained <= 0:
            return None
        return (time.monotonic() - self.started) / trained * (self.total - done)

    def advance(self, done: int, metrics: dict) -> None:
        """``done`` steps finished (0-based step ``done - 1`` just ended with ``metrics``)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=done, status=bar_values(metrics))
            return
        now = time.monotonic()
        due = (done - self.start_step) % self.every == 0 or done == self.total
        if not due and not (self.every_s and now - self._last_line >= self.every_s):
            return
        self._last_line = now
        remaining = self.remaining_s(done)
        fields = [f"step {done}/{self.total}", step_values(metrics)]
        if metrics.get("time/step") is not None:
            fields.append(f"{metrics['time/step']:.2f} s/step")
        if metrics.get("throughput/tokens_per_s") is not None:
            fields.append(f"{metrics['throughput/tokens_per_s']:.0f} tokens/s")
        fields.append(f"elapsed {clock(now - self.started)}")
        if remaining is not None:
            fields.append(f"remaining {clock(remaining)}")
        log.info("%s", "  ".join(f for f in fields if f))

    def close(self, done: int) -> None:
        if self._bar is not None:
            self._bar.stop()
        trained = done - self.start_step
        if trained > 0:
            log.info(
                "trained steps %d-%d of %d in %s",
                self.start_step,
                done - 1,
                self.total,
                clock(time.monotonic() - self.started),
            )
