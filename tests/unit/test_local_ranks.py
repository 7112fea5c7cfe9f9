"""local_ranks: ranks started under gloo on a machine with GPUs see none (they run the CPU path whole), and values
come back on the CPU."""

import collections
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


def test_values_come_back_on_the_cpu_with_their_structure():
    Pair = collections.namedtuple("Pair", "a b")
    meta = torch.empty(2, 3, device="meta")  # a non-CPU tensor on any machine (no data: .to() is spied on)
    value = {"x": [meta, (1, "s")], "pair": Pair(1, 2), "n": 3}
    moved = []
    original = torch.Tensor.to
    torch.Tensor.to = lambda self, device: moved.append((tuple(self.shape), device)) or torch.zeros(self.shape)
    try:
        out = local_ranks.to_device(value, "cpu")
    finally:
        torch.Tensor.to = original
    assert moved == [((2, 3), "cpu")]
    assert out["x"][0].device.type == "cpu" and out["x"][1] == (1, "s") and out["n"] == 3
    assert out["pair"] == Pair(1, 2)
