"""A teacher behind SGLang servers (the test server on an HF model written by transformers): its log-probs at the
sampled tokens and its top-k equal transformers' own on the same sequences, impossible answers are retried and then
refused naming the field, and a training run distils from it (distill.teacher.source=server)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_kl.distill.config import TeacherServer
from megatron_kl.distill.served import ServedTeacher
from megatron_kl.models import pipeline
from megatron_kl.rollout.http import ServerUnavailable
from megatron_kl.rollout.servers import ManagedServer, server_port
from megatron_kl.train.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from hf_workers import hf_logits, make_hf_model  # noqa: E402

K = 5


def _serve(model_dir, log_dir, *faults):
    port = server_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "megatron_kl.testing.sglang_server",
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        *faults,
    ]
    server = ManagedServer(f"teacher-{port}", command, url, log_dir, startup_timeout_s=120)
    server.start()
    return server


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("teacher") / "hf", seed=3)


@pytest.fixture(scope="module")
def clean_server(teacher_dir, tmp_path_factory):
    server = _serve(teacher_dir, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _batch():
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(1, 61, (4, 12), generator=g)
    mask = torch.zeros(4, 11)
    mask[0, 3:] = 1
    mask[1, 5:8] = 1  # a shorter response, padding after it
    mask[3, 1:] = 1  # a one-token prompt
    return pipeline.SequenceBatch(tokens, mask)  # row 2: all masked, never asked for


def _teacher(url, k=K, retries=2):
    cfg = TeacherServer(urls=[url], max_retries=retries, backoff_s=0.01, request_timeout_s=60)
    return ServedTeacher(cfg, vocab_size=61, top_k=k, topology=Topology())


def test_served_log_probs_and_top_k_equal_transformers(teacher_dir, clean_server):
    batch = _batch()
    teacher = _teacher(clean_server.url)
    vocab = pipeline.VocabOptions(vocab_size=61)
    stats = teacher.score(batch, 1, vocab)
    ids, top = teacher.top_k(None, K, vocab, None)
    logp = torch.log_softmax(hf_logits(teacher_dir, batch.tokens).double(), -1)[:, :-1]
    on = batch.loss_mask.bool()
    chosen = logp.gather(-1, batch.tokens[:, 1:, None])[..., 0]
    assert (stats.logprobs[on].double() - chosen[on]).abs().max() < 1e-4
    assert (stats.logprobs[~on] == 0).all() and (stats.entropy == 0).all()
    expected = logp.topk(K, -1)
    assert torch.equal(ids[on], expected.indices[on])
    assert (top[on].double() - expected.values[on]).abs().max() < 1e-4


def test_impossible_answers_are_retried_then_refused_naming_the_field(teacher_dir, tmp_path, clean_server):
    batch = _batch()
    vocab = pipeline.VocabOptions(vocab_size=61)
    good = _teacher(clean_server.url).score(batch, 1, vocab)
    flaky = _serve(teacher_dir, tmp_path, "--fault-scores-every", "2")  # every second answer impossible
    try:
        stats = _teacher(flaky.url, retries=3).score(batch, 1, vocab)
        assert torch.allclose(stats.logprobs, good.logprobs, atol=1e-6)
    finally:
        flaky.stop()
    broken = _serve(teacher_dir, tmp_path, "--fault-scores-every", "1")
    try:
        with pytest.raises(ServerUnavailable, match=r"teacher server .*meta_info\.input_(token|top)_logprobs"):
            _teacher(broken.url, retries=1).score(batch, 1, vocab)
    finally:
        broken.stop()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_distils_from_a_served_teacher(tmp_path, ranks):
    """One rank, and two tensor-parallel ranks (the first asks, the other receives its answers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_kl.testing.distributed import run_ranks
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    directory = tmp_path / "teacher"
    AutoModelForCausalLM.from_config(config).float().save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    server = _serve(directory, tmp_path)
    try:
        cfg = short_config(
            tmp_path / "run",
            str(tmp_path / "cache"),
            "train.steps=2",
            "distill.enabled=true",
            "kl.estimator=k3",
            "kl.coef=0.01",
            "warm_start.steps=30",
            "warm_start.seed=5",
            "distill.teacher.source=server",
            f"distill.teacher.server.urls=[{server.url}]",
            "distill.kl.estimator=topk",
            "distill.kl.top_k=4",
            f"parallel.tensor_parallel={ranks}",
        )
        out = run_ranks(train_worker, ranks, cfg, timeout_s=600)[0]
    finally:
        server.stop()
    steps = [r for r in out["metrics"] if "distill/topk_token" in r]
    assert len(steps) == 2 and out["summary"].run_name.startswith("distill-topk4_bucket-loss-sequence-coef1-")
    for record in steps:
        # a random teacher: far from the student, and the top-k divergence a lower bound of what k1 estimates
        assert 0.05 < record["distill/topk_token"] < 10 and record["loss/distill_term"] != 0
        assert "distill/exact_token" not in record  # no teacher logits in the job
        assert record["time/teacher"] > 0
