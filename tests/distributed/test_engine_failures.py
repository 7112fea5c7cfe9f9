"""Rank 0 owns the served engine; whatever goes wrong there must reach every rank at once, never leave the others
waiting in a collective: servers lost -> EngineLost on every rank; any other error -> raised on rank 0 and
reported on the others; a failure while creating the engine too."""

from __future__ import annotations

import pytest

from megatron_kl.rollout.distributed import DistributedEngine
from megatron_kl.rollout.engine import EngineLost, SamplingConfig
from megatron_kl.rollout.http import ServerUnavailable
from megatron_kl.testing.distributed import run_ranks


class _Broken:
    def __init__(self, error):
        self.error = error

    def generate(self, prompts, sampling, seed=None):
        raise self.error

    def shutdown(self):
        pass


def _worker(rank, world, where, error):
    def make():
        if where == "init":
            raise error
        return _Broken(error)

    try:
        engine = DistributedEngine(make, model=None, dp_rank=rank, timeout_s=60)
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2), seed=0)
    except EngineLost as err:
        return ("EngineLost", str(err))
    except Exception as err:  # noqa: BLE001
        return (type(err).__name__, str(err))
    return ("ok", "")


@pytest.mark.parametrize("where", ["init", "generate"])
@pytest.mark.parametrize(
    "error, rank0, others",
    [
        (ServerUnavailable("http://s:1 is gone"), "EngineLost", "EngineLost"),
        (ValueError("bad field output_ids"), "ValueError", "RuntimeError"),
    ],
)
def test_rank0_engine_failures_reach_every_rank(where, error, rank0, others):
    results = run_ranks(_worker, 2, where, error, timeout_s=120)
    assert results[0][0] == rank0 and results[1][0] == others, results
    assert all(("http://s:1 is gone" if rank0 == "EngineLost" else "bad field output_ids") in msg for _, msg in results)
