"""Delta weight sync against the SGLang test server, for each strategy: after a full first sync only what changed is
sent, and the server generates exactly what a server given the same weights in full generates (its weights are the
trainer's bit for bit); a restart, a version gap and a corrupted delta each end in a full sync with the same
result."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_kl.rollout.config import SGLangConfig
from megatron_kl.rollout.delta import DeltaTracker
from megatron_kl.rollout.servers import server_port
from megatron_kl.rollout.sglang import SGLangEngine
from megatron_kl.rollout.sglang_sync import FromDisk, FromDistributed, FromTensor
from tests.e2e.test_sglang import (  # noqa: F401
    PROMPTS,
    SAMPLING,
    TEST_SERVER,
    _hf_tensors,
    _model,
    _same,
    clean,
    models,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))


def _delta_engine(tmp_path, model_dir, sync, *faults, check_interval=2, **cfg):
    config = SGLangConfig(
        weight_sync=sync,
        sync_dir=str(tmp_path / "sync"),
        extra_args=list(faults),
        startup_timeout_s=120,
        backoff_s=0.05,
        server_module=TEST_SERVER,
        port=server_port(),
        **cfg,
    )
    tracker = DeltaTracker(check_interval=check_interval)
    weight_sync = {
        "from_disk": lambda: FromDisk(config, _model(model_dir), delta=tracker),
        "from_tensor": lambda: FromTensor(config, delta=tracker),
        "from_distributed": lambda: FromDistributed(config, backend="gloo", delta=tracker),
    }[sync]()
    return SGLangEngine(config, weight_sync, str(model_dir), log_dir=tmp_path / "logs", seed=0)


def _versions(model_dir, count: int, fraction: float = 0.01):
    """Version 1 = the model; each next version moves ~``fraction`` of the elements of every other tensor."""
    tensors = _hf_tensors(model_dir)
    out = [tensors]
    for v in range(1, count):
        g = torch.Generator().manual_seed(v)
        step = []
        for i, (name, t) in enumerate(out[-1]):
            if i % 2 == v % 2:
                moved = torch.rand(t.shape, generator=g) < fraction
                t = torch.where(moved, t + 0.01 * torch.randn(t.shape, generator=g).to(t.dtype), t)
            step.append((name, t))
        out.append(step)
    return out


def _reference(clean, tensors, version):
    clean.update_weights(tensors, 100 + version)
    return clean.generate(PROMPTS, SAMPLING, seed=version)


@pytest.mark.parametrize("sync", ["from_tensor", "from_disk", "from_distributed"])
def test_delta_syncs_send_what_changed_and_leave_the_trainers_weights(tmp_path, models, clean, sync):
    versions = _versions(models["a"], 4)
    engine = _delta_engine(tmp_path, models["a"], sync)
    try:
        for version, tensors in enumerate(versions, start=1):
            engine.update_weights(tensors, version)
            stats = engine.last_sync
            assert stats.kind == ("full" if version == 1 else "delta"), stats
            if version > 1:
                assert stats.tensors < stats.tensors_total and 0 < stats.bytes_sent < stats.bytes_full
                if sync == "from_tensor":  # elements: ~1 % of half the tensors, 4 + 4 bytes each
                    assert stats.bytes_sent < 0.05 * stats.bytes_full, stats
            assert stats.checked == (version == 3)  # every tensor's checksum on the cadence (check_interval=2)
            _same(engine.generate(PROMPTS, SAMPLING, seed=version), _reference(clean, tensors, version))
    finally:
        engine.shutdown()


def test_a_restarted_server_and_a_version_gap_get_full_syncs(tmp_path, models, clean, caplog):
    versions = _versions(models["a"], 4)
    engine = _delta_engine(
        tmp_path,
        models["a"],
        "from_tensor",
        "--fault-exit-on-update",
        "3",
        "--fault-marker",
        str(tmp_path / "died"),
        max_retries=1,
    )
    try:
        engine.update_weights(versions[0], 1)
        engine.update_weights(versions[1], 2)
        engine.update_weights(versions[2], 3)  # the server dies on this update: restarted, sent 2 in full, then 3
        assert (tmp_path / "died").exists() and engine.counters["restarts"] == 1
        _same(engine.generate(PROMPTS, SAMPLING, seed=3), _reference(clean, versions[2], 3))
        engine.call(0, "/update_weights_from_disk", {"model_path": str(models["b"]), "weight_version": "elsewhere"})
        engine.update_weights(versions[3], 4)  # the server holds another version: full
        assert engine.last_sync.kind == "full" and "holds version 'elsewhere'" in engine.last_sync.reason
        _same(engine.generate(PROMPTS, SAMPLING, seed=4), _reference(clean, versions[3], 4))
    finally:
        engine.shutdown()
    assert "restarted, sending version 2 in full" in caplog.text


def test_a_corrupted_delta_is_rejected_whole_and_followed_by_a_full_sync(tmp_path, models, clean, caplog):
    versions = _versions(models["a"], 3)
    engine = _delta_engine(tmp_path, models["a"], "from_tensor", "--fault-delta-at", "2")
    try:
        engine.update_weights(versions[0], 1)
        _same(engine.generate(PROMPTS, SAMPLING, seed=1), _reference(clean, versions[0], 1))
        engine.update_weights(versions[1], 2)  # the server's loader gets an altered value: rejected, then full
        assert engine.last_sync.kind == "full" and "delta rejected" in engine.last_sync.reason
        _same(engine.generate(PROMPTS, SAMPLING, seed=2), _reference(clean, versions[1], 2))
        engine.update_weights(versions[2], 3)
        assert engine.last_sync.kind == "delta"
        _same(engine.generate(PROMPTS, SAMPLING, seed=3), _reference(clean, versions[2], 3))
    finally:
        engine.shutdown()
    assert "rejected the delta" in caplog.text and "checksum" in caplog.text


@pytest.mark.parametrize("tp", [1, 2])
def test_the_embedded_engine_copies_only_changed_elements_and_repairs_a_drifted_replica(tp):
    """The embedded engine diffs the policy against its replica itself (no record that could go stale), so a replica
    element changed behind the trainer's back is simply part of the next delta; every tensor's checksum is compared
    on the cadence (the 4th sync)."""
    from megatron_kl.testing.distributed import run_ranks
    from tests.e2e.test_engine import MODEL
    from tests.e2e.workers import delta_engine_worker

    for out in run_ranks(delta_engine_worker, tp, MODEL, tp):
        assert all(out["identical"]), out["identical"]
        assert [s.kind for s in out["stats"]] == ["full"] + ["delta"] * 4
        assert [s.checked for s in out["stats"]] == [False, False, False, True, False]
        for stats in out["stats"][1:]:
            assert 0 < stats.elements < 0.05 * stats.elements_total and stats.bytes_sent < 0.1 * stats.bytes_full


def test_training_with_delta_sync_stays_on_policy(tmp_path, warm_cache):
    """On-policy training (staleness 0) on the test server with rollout.delta_sync: after the full first sync every
    step's sync is a delta, a small share of a full one, and the trainer's log-probs equal the server's at every step
    (its weights are the trainer's)."""
    from megatron_kl.testing.distributed import run_ranks
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    cfg = short_config(
        tmp_path / "run",
        warm_cache,
        "rollout.engine=sglang",
        "rollout.sglang.weight_sync=from_tensor",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        "rollout.delta_sync=true",
        "rollout.delta_check_interval=2",
        "train.steps=3",
    )
    metrics = run_ranks(train_worker, 1, cfg, timeout_s=600)[0]["metrics"]
    steps = [m for m in metrics if "weight_sync/bytes" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert m["weight_sync/full"] == 0 and 0 < m["weight_sync/bytes"] < m["weight_sync/bytes_full"], m
        assert m["mismatch/abs_logprob_max"] < 1e-4, m
