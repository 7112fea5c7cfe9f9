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
