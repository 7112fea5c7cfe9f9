"""Delta weight sync (rollout.delta_sync): per-tensor diffs that reproduce the trainer's tensors bit for bit, the
wire format through SGLang's custom weight loader, and the refusals that leave the receiver's weights untouched."""

from __future__ import annotations

import pytest
import torch

from megatron_kl.rollout import sglang_loader
from megatron_kl.rollout.delta import COMMIT, DeltaRejected, DeltaTracker, apply_encoded, diff, encode, tensor_checksum
from megatron_kl.rollout.sglang_loader import sglang_delta_loader


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
    changed = int(
        (
            held.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
            != new.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
        ).sum()
    )
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
    assert model.loaded == [["t0", "t1", "t2"]] and torch.equal(sglang_loader._HELD[id(model)]["t1"], held["t1"])
    sglang_delta_loader(model, _encoded_sync(held, new, 2))
    assert model.loaded[-1] == ["t1"] and torch.equal(sglang_loader._HELD[id(model)]["t1"], new["t1"])


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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.delta_sync=true", "rollout.quantization=fp8"],
            "rollout.delta_sync=true with rollout.engine=local and",
        ),
        (["rollout.delta_check_interval=0"], "rollout.delta_check_interval"),
    ],
)
def test_delta_syncs_that_cannot_work_are_refused_naming_the_field(tmp_path, overrides, message):
    from megatron_kl.config import ConfigError, from_dict
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig
    from tests.e2e.runs import short_config

    with pytest.raises(ConfigError, match=message):
        cfg = from_dict(TrainConfig, short_config(tmp_path, str(tmp_path / "cache"), *overrides))
        validate_train_config(cfg, cfg.model.vocab_size, 1)


def test_the_committed_tensors_a_restarted_server_is_sent_are_copies():
    """What a restarted server is brought back to (the committed version) must not follow the CPU parameters an
    optimizer step changes in place after the sync."""
    from megatron_kl.rollout.config import SGLangConfig
    from megatron_kl.rollout.sglang_sync import FromTensor

    param = torch.randn(16, 16)
    prepared = FromTensor(SGLangConfig(weight_sync="from_tensor")).prepare([("w", param), ("half", param[:8])], 3)
    before = [t.clone() for _, t in prepared]
    with torch.no_grad():
        param.add_(1.0)
    assert all(torch.equal(t, b) for (_, t), b in zip(prepared, before))


# -- vLLM's receiver (rollout/vllm_delta.py), with a stand-in for vLLM's worker ------------------------------------

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_a_changed_tensor_reloads_every_tensor_of_its_vllm_layer():
    from megatron_kl.rollout.vllm_delta import layer_of, layers_to_reload

    held = [
        f"model.layers.{i}.{m}.{p}"
        for i in (0, 1)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
        )
        for p in ("weight", "bias")
        if p == "weight" or "_proj" in m and "self_attn" in m and "o_proj" not in m
    ]
    held = ["model.embed_tokens.weight", *held, "model.norm.weight", "lm_head.weight"]
    assert layer_of("model.layers.3.self_attn.k_proj.bias", PACKED) == "model.layers.3.self_attn.qkv_proj"
    assert layer_of("model.layers.3.mlp.down_proj.weight", PACKED) == "model.layers.3.mlp.down_proj"
    assert layer_of("model.norm.weight", PACKED) == "model.norm"
    reload = layers_to_reload(
        ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"], held, PACKED
    )
    assert reload == [f"model.layers.0.mlp.{m}_proj.weight" for m in ("gate", "up")] + [
        f"model.layers.1.self_attn.{m}_proj.{p}" for m in "qkv" for p in ("weight", "bias")
    ]
    assert layers_to_reload([], held, PACKED) == []


class _Runner:
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


class _Worker:
    """What the extension uses of vLLM's worker: model_runner.get_model() and reload_weights."""

    def __init__(self):
        from types import SimpleNamespace

        self.model_runner = _Runner(SimpleNamespace(packed_modules_mapping=PACKED))
        self.reloads = []

    def reload_weights(self, weights_iterator):
        self.reloads.append({name: tensor.clone() for name, tensor in weights_iterator})


def _vllm_worker():
    from megatron_kl.rollout.vllm_delta import DeltaWorkerExtension

    return type("Extended", (_Worker, DeltaWorkerExtension), {})()


def test_the_vllm_extension_reloads_changed_layers_whole_and_nothing_on_a_rejected_sync(tmp_path):
    from megatron_kl.rollout.vllm_delta import read_entries, write_entries

    names = [f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkvo"] + ["model.norm.weight"]
    weights = {
        n: torch.randn(48, 32, generator=torch.Generator().manual_seed(i)).bfloat16() for i, n in enumerate(names)
    }
    worker = _vllm_worker()
    assert worker.megatron_kl_weight_version() == {"version": None}
    path = write_entries(_encoded_sync({}, weights, 1), tmp_path / "full.safetensors")
    assert worker.megatron_kl_load(path=str(path)) == {"success": True, "version": 1, "reloaded_tensors": 5}
    assert sorted(worker.reloads[0]) == sorted(names) and worker.megatron_kl_weight_version() == {"version": 1}
    # a step that changes 1 % of k_proj: q, k and v reload whole (from the host copy), o_proj and the norm do not
    new = dict(weights, **{names[1]: _step(weights[names[1]], 0.01, 3)})
    entries = read_entries(str(write_entries(_encoded_sync(weights, new, 2), tmp_path / "delta.safetensors")))
    assert f"{names[1]}@delta:indices" in dict(entries)
    assert worker.megatron_kl_load(entries=entries)["reloaded_tensors"] == 3
    assert sorted(worker.reloads[1]) == sorted(names[:3])
    assert all(torch.equal(worker.reloads[1][n], new[n]) for n in names[:3])
    # a delta computed against another base than the receiver's (its o_proj differs at one element the delta does
    # not touch): rejected, nothing reloaded, the version and the host copy kept
    drifted = dict(new, **{names[3]: new[names[3]].clone()})
    drifted[names[3]].view(-1)[0] += 1
    newer = dict(drifted, **{names[3]: _step(drifted[names[3]], 0.01, 5)})
    newer[names[3]].view(-1)[0] = drifted[names[3]].view(-1)[0]
    answer = worker.megatron_kl_load(entries=_encoded_sync(drifted, newer, 3))
    assert answer["success"] is False and answer["message"].startswith("DeltaRejected: ")
    assert len(worker.reloads) == 2 and worker.megatron_kl_weight_version() == {"version": 2}
    assert torch.equal(worker._megatron_kl_held[names[3]], new[names[3]])


def test_a_vllm_server_without_the_delta_extension_is_refused_at_start_naming_the_field(monkeypatch):
    from megatron_kl.config import ConfigError
    from megatron_kl.rollout import vllm
    from megatron_kl.rollout.config import VLLMConfig
    from megatron_kl.rollout.http import ServerError

    def call(url, route, payload, policy, method="POST", **_):
        if route == "/v1/models":
            return {"data": [{"id": "served"}]}
        raise ServerError(f"{url}{route} answered 404: Not Found")  # no dev mode, or no extension method

    monkeypatch.setattr(vllm, "call", call)
    config = VLLMConfig(mode="server", url="http://127.0.0.1:1")
    assert vllm.VLLMEngine(config, None, None).delta is None  # without delta sync nothing is asked
    with pytest.raises(
        ConfigError,
        match="rollout.delta_sync=true: .*--worker-extension-cls megatron_kl.rollout.vllm_delta.DeltaWorkerExtension",
    ):
        vllm.VLLMEngine(config, None, None, delta=DeltaTracker())
