"""Stop signals: recorded by the handler, agreed across ranks, handlers restored; bad names are config errors."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.run.preemption import StopSignals
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.config import LoopConfig


def test_signal_is_recorded_and_previous_handler_restored():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append("old"))
    try:
        stop = StopSignals(["SIGTERM", "SIGUSR1"])
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed() == "SIGUSR1" and seen == []  # recorded, the process lives on
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == "SIGUSR1"  # the first one counts
        stop.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == ["old"]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("names", [["SIGKILL"], "SIGTERM", ["SIGTERM", 15]])
def test_bad_stop_signal_names_are_config_errors(names):
    with pytest.raises(ConfigError, match="train.stop_signals"):
        LoopConfig(stop_signals=names)


def _agree_worker(rank, world, signalled_rank):
    stop = StopSignals(["SIGUSR1"])
    try:
        if rank == signalled_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        return stop.agreed()
    finally:
        stop.close()


@pytest.mark.parametrize("signalled_rank, expected", [(1, "SIGUSR1"), (None, None)])
def test_every_rank_learns_that_one_rank_was_signalled(signalled_rank, expected):
    assert run_ranks(_agree_worker, 2, signalled_rank) == [expected, expected]
