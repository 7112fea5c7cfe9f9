"""Delta weight sync (rollout.delta_sync): per-tensor diffs that reproduce the trainer's tensors bit for bit, the
wire format through SGLang's custom weight loader, and the refusals that leave the receiver's weights untouched."""

from __future__ import annotations

import pytest
import torch

from megatron_kl.rollout import delta
from megatron_kl.rollout.delta import (COMMIT, DeltaRejected, DeltaTracker, apply_encoded, diff, encode,
                                       sglang_delta_loader, tensor_checksum)


def _step(tensor: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``tensor`` with about ``fraction`` of its elements moved (an optimizer step that most elements round away)."""
    g = torch.Generator().manual_seed(seed)
    moved = torch.rand(tensor.shape, generator=g) < fraction
    return torch.where(moved, tensor + 0.05 * torch.randn(tensor.shape, generator=g).to(tensor.dtype), tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_a_diff_reproduces_the_new_tensor_bit_for_bit_and_sends_the_smaller_form(dtype, fraction):
    held = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    new = _step(held, fraction, 1)
    update = diff("w", held, new)
    changed = int((held.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
                   != new.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)).sum())
    if changed == 0:
        assert update is None
        return
    result = update.apply_to(held.clone())
    assert torch.equal(result.view(torch.uint8), new.view(torch.uint8)) and update.checksum == tensor_checksum(new)
    sparse_bytes = changed * (4 + new.element_size())
    assert update.nbytes == min(sparse_bytes, new.numel() * new.element_size()) or update.full is not None
    assert (update.full is None) == (sparse_bytes < new.numel() * new.element_size())


def test_signed_zeros_and_nan_payloads_are_changes():
    held = torch.cat([torch.tensor([0.0, 1.0, float("nan")]), torch.ones(20)])
    new = held.clone()
    new[0] = -0.0
    new.view(torch.int32)[2] = held.view(torch.int32)[2] ^ 1  # another NaN
    update = diff("w", held, new)
    assert update is not None and update.full is None and update.indices.tolist() == [0, 2]
    assert torch.equal(update.apply_to(held.clone()).view(torch.int32), new.view(torch.int32))


def test_the_tracker_plans_a_full_first_sync_then_deltas_and_checks_every_tensor_on_its_cadence():
    weights = {f"t{i}": torch.randn(32, 32, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(4)}
    tracker = DeltaTracker(check_interval=2)
    updates, tensors, stats = tracker.plan(weights.items())
    assert stats.kind == "full" and stats.reason == "first sync" and stats.bytes_sent == stats.bytes_full
    tracker.commit(tensors, 1, stats)
    weights["t2"] = _step(weights["t2"], 0.02, 3)
    updates, tensors, stats = tracker.plan(weights.items())
    assert stats.kind == "delta" and [u.name for u in updates] == ["t2"] and not stats.checked
    assert 0 < stats.bytes_sent < stats.bytes_full / 20 and stats.metrics()["weight_sync/changed_tensors"] == 0.25
    tracker.commit(tensors, 2, stats)
    _, _, stats = tracker.plan(weights.items())
    assert stats.checked and stats.bytes_sent == 0  # nothing changed; every checksum travels this time
    _, _, forced = tracker.plan(weights.items(), "server restarted")
    assert forced.kind == "full" and forced.reason == "server restarted"


def _encoded_sync(held: dict, new: dict, version: int, every: bool = False):
    tracker = DeltaTracker()
    tracker.held, tracker.version = {k: v.clone() for k, v in held.items()}, version - 1
    updates, tensors, stats = tracker.plan(new.items())
    return encode(updates, tracker.checksums(tensors, every, updates), version)


def test_the_encoded_sync_applies_to_copies_and_checks_every_checksum():
    held = {f"t{i}": torch.randn(40, 40, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3)}
    new = dict(held, t1=_step(held["t1"], 0.01, 5), t2=_step(held["t2"], 0.9, 6))
    entries = _encoded_sync(held, new, 7, every=True)
    names = [n for n, _ in entries]
    assert "t1@delta:indices" in names and "t2" in names and names[-1] == COMMIT
    before = {k: v.clone() for k, v in held.items()}
    staged = apply_encoded(held, entries)
    assert sorted(staged) == ["t1", "t2"] and all(torch.equal(staged[k], new[k]) for k in staged)
    assert all(torch.equal(held[k], before[k]) for k in held)  # applied to copies
    drifted = dict(held, t0=held["t0"].clone())
    drifted["t0"].view(-1)[3] += 1  # the receiver's t0 is not the trainer's: caught on a full-check sync
    with pytest.raises(DeltaRejected, match="t0: checksum"):
        apply_encoded(drifted, entries)
    with pytest.raises(DeltaRejected, match="t1: a delta arrived for a tensor this receiver does not hold"):
        apply_encoded({"t0": held["t0"]}, entries)
    corrupt = [(n, t.clone()) for n, t in entries]
    values = next(t for n, t in corrupt if n == "t1@delta:values")
    values[0] = values[0] + 1
    with pytest.raises(DeltaRejected, match="t1: checksum after applying"):
        apply_encoded(held, corrupt)


class _Model:
    def __init__(self):
        self.loaded = []

    def load_weights(self, named):
        self.loaded.append(sorted(name for name, _ in named))


def test_the_sglang_loader_waits_for_the_commit_and_loads_nothing_on_a_rejected_sync():
    model = _Model()
    held = {f"t{i}": torch.randn(40, 40, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3)}
    full = _encoded_sync({}, held, 1)
    sglang_delta_loader(model, full[:2])  # first bucket: kept until the commit
    assert model.loaded == []
    sglang_delta_loader(model, full[2:])
    assert model.loaded == [["t0", "t1", "t2"]]
    new = dict(held, t1=_step(held["t1"], 0.01, 9))
    bad = [(n, t.clone()) for n, t in _encoded_sync(held, new, 2)]
    next(t for n, t in bad if n == "t1@delta:values")[0] += 1
    with pytest.raises(DeltaRejected):
        sglang_delta_loader(model, bad)
    assert model.loaded == [["t0", "t1", "t2"]] and torch.equal(delta._HELD[id(model)]["t1"], held["t1"])
    sglang_delta_loader(model, _encoded_sync(held, new, 2))
    assert model.loaded[-1] == ["t1"] and torch.equal(delta._HELD[id(model)]["t1"], new["t1"])


def test_the_tracker_keeps_copies_not_the_live_parameters():
    """The committed record must not follow the parameters an optimizer updates in place (a CPU parameter, or a view
    of one, comes out of the HF conversion as the same storage)."""
    param = torch.randn(64, 64)
    tracker = DeltaTracker()
    _, tensors, stats = tracker.plan([("w", param), ("view", param[:32])])
    tracker.commit(tensors, 1, stats)
    with torch.no_grad():
        param[0, :8] += 1.0  # the optimizer step
    updates, _, stats = tracker.plan([("w", param), ("view", param[:32])])
    assert [u.name for u in updates] == ["w", "view"] and all(u.changed == 8 for u in updates)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.delta_sync=true", "rollout.engine=vllm"], "rollout.delta_sync=true with rollout.engine=vllm"),
    (["rollout.delta_sync=true", "rollout.quantization=fp8"], "rollout.delta_sync=true with rollout.engine=local and"),
    (["rollout.delta_check_interval=0"], "rollout.delta_check_interval"),
])
def test_delta_syncs_that_cannot_work_are_refused_naming_the_field(tmp_path, overrides, message):
    from megatron_kl.config import ConfigError, from_dict
    from megatron_kl.train.config import TrainConfig, validate_train_config
    from tests.e2e.test_train import short_config

    with pytest.raises(ConfigError, match=message):
        cfg = from_dict(TrainConfig, short_config(tmp_path, str(tmp_path / "cache"), *overrides))
        validate_train_config(cfg, cfg.model.vocab_size, 1)


def test_the_committed_tensors_a_restarted_server_is_sent_are_copies():
    """What a restarted server is brought back to (the committed version) must not follow the CPU parameters an
    optimizer step changes in place after the sync."""
    from megatron_kl.rollout.config import SGLangConfig
    from megatron_kl.rollout.weight_sync import FromTensor

    param = torch.randn(16, 16)
    prepared = FromTensor(SGLangConfig(weight_sync="from_tensor")).prepare([("w", param), ("half", param[:8])], 3)
    before = [t.clone() for _, t in prepared]
    with torch.no_grad():
        param.add_(1.0)
    assert all(torch.equal(t, b) for (_, t), b in zip(prepared, before))
