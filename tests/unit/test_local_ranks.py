"""local_ranks: ranks started under gloo on a machine with GPUs see none (they run the CPU path whole), and values
come back on the CPU."""

import collections
import dataclasses
import os

import torch

from megatron_kl import local_ranks


def test_gpus_hidden_only_while_starting_and_restored(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with local_ranks._gpus_hidden(True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with local_ranks._gpus_hidden(True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with local_ranks._gpus_hidden(False):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Result:
    logprobs: torch.Tensor
    name: str
    extra: dict = dataclasses.field(default_factory=dict)
    derived: int = dataclasses.field(init=False, default=7)


def test_values_come_back_on_the_cpu_with_their_structure():
    def meta(*shape):  # a non-CPU tensor on any machine (no data: .to() is spied on)
        return torch.empty(*shape, device="meta")

    result = Result(meta(4), "policy", {"kl": meta(5)})
    value = {"x": [meta(2, 3), (1, "s")], "pair": Pair(meta(6), 2), "result": result, "n": 3}
    moved = []
    original = torch.Tensor.to
    torch.Tensor.to = lambda self, device: moved.append((tuple(self.shape), device)) or torch.zeros(self.shape)
    try:
        out = local_ranks.to_device(value, "cpu")
    finally:
        torch.Tensor.to = original
    assert sorted(moved) == sorted([((2, 3), "cpu"), ((6,), "cpu"), ((4,), "cpu"), ((5,), "cpu")])
    assert out["x"][0].device.type == "cpu" and out["x"][1] == (1, "s") and out["n"] == 3
    assert type(out["pair"]) is Pair and out["pair"].a.device.type == "cpu" and out["pair"].b == 2
    back = out["result"]
    assert type(back) is Result and back.logprobs.device.type == "cpu" and back.extra["kl"].device.type == "cpu"
    assert back.name == "policy" and back.derived == 7
    assert result.logprobs.device.type == "meta" and result.extra["kl"].device.type == "meta"  # not mutated


def _environment_worker(rank, world, name):
    import sys

    return os.environ.get(name), os.getcwd(), "megatron_kl.train.loop" in sys.modules


def test_ranks_see_the_callers_environment_at_each_call(monkeypatch, tmp_path):
    """Ranks are forked from a fork server started at the first call (its environment frozen then): each call's
    ranks still get the caller's environment and working directory of that moment, and the trainer is already
    imported in them."""
    first = local_ranks.run_ranks(_environment_worker, 1, "MEGATRON_KL_TEST_VALUE")[0]
    monkeypatch.setenv("MEGATRON_KL_TEST_VALUE", "changed after the server started")
    monkeypatch.chdir(tmp_path)
    second = local_ranks.run_ranks(_environment_worker, 2, "MEGATRON_KL_TEST_VALUE")
    preloaded = local_ranks._context().get_start_method() == "forkserver"  # spawned ranks import on their own
    assert first[0] is None
    assert all(value == ("changed after the server started", str(tmp_path), preloaded) for value in second)
