"""Stopping a run cleanly: on a signal (Ctrl-C, a closed terminal, Slurm's time limit or preemption) or when the
rollout servers are lost.

Slurm sends ``--signal=USR1@<lead>`` seconds before the time limit (the sbatch scripts request it) and SIGTERM on
preemption or ``scancel``; torchrun forwards both to its workers (``PET_SIGNALS_TO_HANDLE``). The handler records
the signal and cancels the rollout engine's HTTP calls (``rollout/http.py``: a hung server cannot hold the run);
at the end of every step (and once before the first) the ranks agree (one MAX all-reduce) whether any rank got
one; if so the trainer writes a checkpoint of the finished steps and stops with :class:`Requeue`. A rollout cut
off by the signal ends the same way at once. Exit codes: 130 after SIGINT (Ctrl-C), :data:`REQUEUE_EXIT_CODE`
(75) after the others; either way the same command resumes. A rollout engine that
stays unavailable after its retries and restarts (:class:`megatron_kl.rollout.engine.EngineLost`, raised on
every rank together) ends the same way, with the checkpoint of the last finished step. ``megatron-kl train``
exits with :data:`REQUEUE_EXIT_CODE`: nonzero, so NeMo-Run's sbatch script requeues the job
(``launch.slurm.retries``) and the restarted run resumes from that checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_kl.child_processes import SIGNALS
from megatron_kl.config import ConfigError
from megatron_kl.models.parallel import all_reduce_cpu

log = logging.getLogger("megatron_kl.train")

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: stopped early with a checkpoint; run the same command again to resume
INTERRUPT_EXIT_CODE = 130  # 128 + SIGINT: the shell's code for Ctrl-C (checkpoint written as well)


class Requeue(Exception):
    """The run stopped before ``train.steps`` after writing a checkpoint; a restart resumes it."""

    def __init__(self, reason: str, step: int, checkpoint, signal_name: Optional[str] = None):
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no step finished, nothing to save"
        self.exit_code = INTERRUPT_EXIT_CODE if signal_name == "SIGINT" else REQUEUE_EXIT_CODE
        super().__init__(
            f"stopped after step {step} ({reason}); {where}; run the same command again to resume "
            f"(exit code {self.exit_code}"
            + (", which requeues a Slurm job)" if self.exit_code == REQUEUE_EXIT_CODE else ")")
        )
        self.reason, self.step, self.checkpoint = reason, step, checkpoint


class TrainingFailed(RuntimeError):
    """The run failed after ``step`` finished RL steps; ``checkpoint``: where they were saved first (None: they
    could not be, ``why_unsaved`` says why). The original exception is the ``__cause__``."""

    def __init__(self, error: BaseException, step: int, checkpoint, why_unsaved: str = "", last_checkpoint=None):
        if checkpoint is not None:
            where = (
                f"the {step} finished step{'s' if step != 1 else ''} are saved in {checkpoint}; run the same "
                "command again to resume from step " + str(step)
            )
        else:
            last = (
                f"the newest checkpoint is {last_checkpoint}" if last_checkpoint is not None else "no checkpoint exists"
            )
            where = f"no checkpoint written ({why_unsaved}); {last}"
        super().__init__(f"{type(error).__name__}: {error}; {where}")
        self.step, self.checkpoint = step, checkpoint


def check_signal_names(names: Sequence[str], where: str = "train.stop_signals") -> list[str]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}={names!r} must be a list of signal names, e.g. [SIGTERM, SIGUSR1]")
    unknown = [n for n in names if n not in SIGNALS]
    if unknown:
        raise ConfigError(f"{where}: {unknown} cannot stop a run; use some of {list(SIGNALS)}")
    return list(names)


class StopSignals:
    """Records the first of ``names`` this process receives (handlers installed from the main thread only;
    the previous handlers come back on :meth:`close`)."""

    def __init__(self, names: Sequence[str]):
        self.received: Optional[int] = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("stop signals %s not handled: the trainer does not run in the main thread", list(names))
            return
        from megatron_kl.rollout.http import clear_cancel

        clear_cancel()
        for name in check_signal_names(names):
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        from megatron_kl.rollout.http import cancel_requests

        if self.received is None:
            self.received = signum
            cancel_requests(f"received {signal.Signals(signum).name}")

    def agreed(self, group=None) -> Optional[str]:
        """Collective over ``group`` (default: the world): the signal some rank received, or None."""
        value = self.received or 0
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            value = int(all_reduce_cpu(torch.tensor([value], dtype=torch.int64), group, dist.ReduceOp.MAX))
        return signal.Signals(value).name if value else None

    def close(self) -> None:
        """Restore the previous handlers; HTTP calls are allowed again (the cancellation was this run's)."""
        from megatron_kl.rollout.http import clear_cancel

        clear_cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
