"""The SGLang client against the test server (SGLang's HTTP API subset on the embedded engine): generation,
the three weight-sync strategies, and failures (500s, timeouts, dropped connections, malformed responses,
stale weight versions, a killed server) without losing or duplicating a sample."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_kl.rollout.config import SGLangConfig
from megatron_kl.rollout.engine import SamplingConfig
from megatron_kl.rollout.http import ServerUnavailable
from megatron_kl.rollout.servers import server_port
from megatron_kl.rollout.sglang import SGLangEngine
from megatron_kl.rollout.sglang_protocol import ResponseError
from megatron_kl.rollout.sglang_sync import FromDisk, FromDistributed, FromTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from hf_workers import make_hf_model  # noqa: E402

TEST_SERVER = "megatron_kl.testing.sglang_server"
PROMPTS = [[1 + (i * 7 + j) % 50 for j in range(3 + i % 4)] for i in range(12)]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=[0])


def _hf_tensors(directory: Path) -> list[tuple[str, torch.Tensor]]:
    from megatron_kl.models.hf import HFCheckpoint

    checkpoint = HFCheckpoint(directory)
    return [(name, checkpoint.get(name)) for name in sorted(checkpoint.files)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_model("qwen2", root / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}


def _engine(tmp_path, model_dir, *faults, sync="from_disk", **cfg):
    cfg.setdefault("server_module", TEST_SERVER)
    if "port" not in cfg:
        cfg["port"] = server_port()
    config = SGLangConfig(
        weight_sync=sync,
        sync_dir=str(tmp_path / "sync"),
        extra_args=list(faults),
        startup_timeout_s=120,
        backoff_s=0.05,
        **cfg,
    )
    weight_sync = {
        "from_disk": lambda: FromDisk(config, _model(model_dir)),
        "from_tensor": lambda: FromTensor(config),
        "from_distributed": lambda: FromDistributed(config, backend="gloo"),
    }[sync]()
    return SGLangEngine(config, weight_sync, str(model_dir), log_dir=tmp_path / "logs", seed=0)


def _model(model_dir):
    from megatron_kl.models.hf import HFCheckpoint

    return HFCheckpoint(model_dir).model_config()


@pytest.fixture(scope="module")
def clean(models, tmp_path_factory):
    """One fault-free server on model a, synced to version 1 = model a (from disk)."""
    tmp = tmp_path_factory.mktemp("clean")
    engine = _engine(tmp, models["a"])
    engine.update_weights(_hf_tensors(models["a"]), 1)
    yield engine
    engine.shutdown()


def _same(got, want):
    assert [c.prompt_ids for c in got] == [c.prompt_ids for c in want]
    assert [c.response_ids for c in got] == [c.response_ids for c in want]
    for a, b in zip(got, want):
        assert torch.allclose(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5)


def test_generate_shapes_order_and_determinism(clean):
    first = clean.generate(PROMPTS, SAMPLING, seed=5)
    assert len(first) == len(PROMPTS)
    for prompt, completion in zip(PROMPTS, first):
        assert completion.prompt_ids == prompt
        assert 1 <= len(completion.response_ids) <= SAMPLING.max_new_tokens
        assert all(lp <= 0.0 and lp == lp for lp in completion.response_logprobs)
        assert completion.weight_version == 1
        assert (completion.finish_reason == "stop") == (completion.response_ids[-1] == 0)
    _same(clean.generate(PROMPTS, SAMPLING, seed=5), first)
    other = clean.generate(PROMPTS, SAMPLING, seed=6)
    assert [c.response_ids for c in other] != [c.response_ids for c in first]


def test_logprobs_equal_the_embedded_engine_on_the_same_weights(clean, models):
    """Behaviour log-probs from the server = the model's tempered log-softmax at each sampled token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["a"], dtype=torch.float32).eval()
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=5, stop_token_ids=[0])
    for completion in clean.generate(PROMPTS[:4], sampling, seed=3):
        tokens = torch.tensor([completion.prompt_ids + completion.response_ids])
        with torch.no_grad():
            logits = model(tokens).logits[0, len(completion.prompt_ids) - 1 : -1] / 0.7
        expected = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(completion.response_ids)[:, None])
        assert torch.allclose(
            torch.tensor(completion.response_logprobs, dtype=torch.float64), expected[:, 0], atol=2e-4
        )


@pytest.mark.parametrize("sync", ["from_disk", "from_tensor", "from_distributed"])
def test_weight_sync_strategies_load_the_pushed_weights(tmp_path, models, clean, sync):
    """After pushing model b, a server started on a generates exactly what a server synced to b from disk does."""
    clean.update_weights(_hf_tensors(models["b"]), 2)
    want_b = clean.generate(PROMPTS, SAMPLING, seed=11)
    clean.update_weights(_hf_tensors(models["a"]), 3)
    want_a = clean.generate(PROMPTS, SAMPLING, seed=11)
    assert [c.response_ids for c in want_a] != [c.response_ids for c in want_b]
    engine = _engine(tmp_path, models["a"], sync=sync)
    try:
        engine.update_weights(_hf_tensors(models["b"]), 7)
        got = engine.generate(PROMPTS, SAMPLING, seed=11)
        _same(got, want_b)
        assert {c.weight_version for c in got} == {7}
        engine.update_weights(_hf_tensors(models["a"]), 8)  # and back: a second push over the same channel
        _same(engine.generate(PROMPTS, SAMPLING, seed=11), want_a)
    finally:
        engine.shutdown()


def test_5xx_timeouts_and_dropped_connections_are_retried_without_loss(tmp_path, models, clean):
    clean.update_weights(_hf_tensors(models["a"]), 4)
    want = clean.generate(PROMPTS, SAMPLING, seed=21)
    engine = _engine(
        tmp_path,
        models["a"],
        "--fault-500-every",
        "3",
        "--fault-drop-every",
        "5",
        "--fault-delay-every",
        "7",
        "--fault-delay-s",
        "3",
        request_timeout_s=1.5,
        max_concurrency=4,
        max_retries=10,
    )
    try:
        engine.update_weights(_hf_tensors(models["a"]), 4)
        got = engine.generate(PROMPTS, SAMPLING, seed=21)
        _same(got, want)  # every prompt answered once, exactly as without faults
        assert engine.counters["retries"] >= 4 and engine.counters["restarts"] == 0
    finally:
        engine.shutdown()


def test_killed_server_is_restarted_resynced_and_requests_reissued(tmp_path, models, clean):
    clean.update_weights(_hf_tensors(models["b"]), 5)
    want = clean.generate(PROMPTS, SAMPLING, seed=31)
    engine = _engine(
        tmp_path,
        models["a"],
        "--fault-exit-at",
        "4",
        "--fault-marker",
        str(tmp_path / "died"),
        max_retries=1,
        max_concurrency=2,
    )
    try:
        engine.update_weights(_hf_tensors(models["b"]), 5)  # the restarted server must get b back, not a
        got = engine.generate(PROMPTS, SAMPLING, seed=31)
        assert (tmp_path / "died").exists()
        assert engine.counters["restarts"] == 1 and engine.counters["reissued"] >= 1
        _same(got, want)
        engine.servers[0].process.kill()  # killed from outside between calls
        engine.servers[0].process.wait()
        _same(engine.generate(PROMPTS, SAMPLING, seed=31), want)
        assert engine.counters["restarts"] == 2
    finally:
        engine.shutdown()


def test_colocated_release_and_resume_around_generation_and_updates(tmp_path, models, clean):
    """colocated: memory released after generating, resumed (weights first, then KV cache) for the next
    update or generation; the test server refuses to generate or load while released."""
    clean.update_weights(_hf_tensors(models["b"]), 6)
    want = clean.generate(PROMPTS, SAMPLING, seed=41)
    engine = _engine(tmp_path, models["a"], "--enable-memory-saver", colocated=True, enable_memory_saver=True)
    try:
        engine.update_weights(_hf_tensors(models["a"]), 1)
        engine.generate(PROMPTS[:2], SAMPLING, seed=0)
        engine.release_memory()
        assert engine.released
        engine.generate(PROMPTS[:2], SAMPLING, seed=0)  # resumed before generating
        engine.release_memory()
        engine.update_weights(_hf_tensors(models["b"]), 6)  # resumed weights, pushed, resumed KV cache
        assert not engine.released
        _same(engine.generate(PROMPTS, SAMPLING, seed=41), want)
        assert engine.counters == {"retries": 0, "restarts": 0, "reissued": 0}  # never hit a released server
    finally:
        engine.shutdown()


def test_a_response_without_logprobs_is_retried_and_one_that_never_has_them_is_named(tmp_path, models):
    """Every 2nd answer lacks meta_info.output_token_logprobs: retried like the other corrupt answers, the batch
    completes. A server that never sends them fails after the retries, naming the field (no restart: the
    server is alive)."""
    engine = _engine(tmp_path / "sometimes", models["a"], "--fault-bad-every", "2")
    try:
        engine.update_weights(_hf_tensors(models["a"]), 1)
        out = engine.generate(PROMPTS[:4], SAMPLING, seed=0)
        assert len(out) == 4 and all(len(c.response_logprobs) == len(c.response_ids) > 0 for c in out)
        assert engine.counters["retries"] >= 2 and engine.counters["restarts"] == 0
    finally:
        engine.shutdown()
    engine = _engine(
        tmp_path / "never", models["a"], "--fault-bad-every", "1", max_retries=1, restart_dead_servers=False
    )
    try:
        engine.update_weights(_hf_tensors(models["a"]), 1)
        with pytest.raises(ServerUnavailable, match="meta_info.output_token_logprobs"):
            engine.generate(PROMPTS[:2], SAMPLING, seed=0)
    finally:
        engine.shutdown()


def test_stale_weight_version_and_dead_external_server(clean, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_KL_SGLANG_API_KEY", clean.api_key)  # given URLs: the key comes from the env
    external = SGLangEngine(SGLangConfig(urls=[clean.urls[0]], backoff_s=0.01), FromTensor(SGLangConfig()))
    external.weight_version = 99  # the server holds another version than this client pushed
    with pytest.raises(ResponseError, match="weight_version"):
        external.generate(PROMPTS[:2], SAMPLING, seed=0)
    with pytest.raises(ServerUnavailable, match="http://127.0.0.1:9 did not answer GET /health"):
        SGLangEngine(SGLangConfig(urls=["http://127.0.0.1:9"], startup_timeout_s=0.5), FromTensor(SGLangConfig()))
    # a given server that dies after the start: not restarted from here, an error saying so
    dead = SGLangEngine(SGLangConfig(urls=[clean.urls[0]], max_retries=1, backoff_s=0.01), FromTensor(SGLangConfig()))
    dead.urls = ["http://127.0.0.1:9"]
    with pytest.raises(ServerUnavailable, match="not managed here"):
        dead.generate(PROMPTS[:2], SAMPLING, seed=0)


@pytest.mark.parametrize("tp, sync", [(1, "from_disk"), (1, "from_distributed"), (2, "from_tensor")])
def test_training_on_sglang_servers_matches_the_trainers_logprobs(tmp_path, warm_cache, tp, sync):
    """rollout.engine=sglang (managed test server started from the trainer's initial HF export): every step's
    rollouts come from the weights pushed after the previous step (weight_version checked per response) and
    the trainer's recomputed log-probs equal the server's behaviour log-probs."""
    from megatron_kl.testing.distributed import run_ranks
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    cfg = short_config(
        tmp_path / "run",
        warm_cache,
        "rollout.engine=sglang",
        f"rollout.sglang.weight_sync={sync}",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        f"parallel.tensor_parallel={tp}",
        "eval.interval=2",
    )
    metrics = run_ranks(train_worker, tp, cfg, timeout_s=600)[0]["metrics"]
    steps = [m for m in metrics if "mismatch/abs_logprob_max" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert m["mismatch/abs_logprob_max"] < 1e-4, m
    assert any("eval/id/pass@1" in m for m in metrics)
    log = (tmp_path / "run" / "sglang" / "sglang-0.log").read_text()
    assert "==== start:" in log and "megatron_kl.testing.sglang_server" in log


def test_async_rollouts_on_sglang_servers_at_tp2(tmp_path, warm_cache):
    """train.staleness=1 with a served engine: the batch of step t+1 is generated in a background thread on
    every rank (prompt gather / completion scatter on the engine's own gloo group) while step t trains at
    TP=2; step 0 is on-policy (trainer log-probs equal the server's), later steps come from the weights of
    the step before, as the staleness metrics and the responses' weight versions say."""
    from megatron_kl.testing.distributed import run_ranks
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    cfg = short_config(
        tmp_path / "run",
        warm_cache,
        "rollout.engine=sglang",
        "rollout.sglang.weight_sync=from_disk",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        "parallel.tensor_parallel=2",
        "train.staleness=1",
        "train.steps=4",
        "kl.estimator=k3",
        "kl.placement=loss",
        "kl.off_policy=token_is",
    )
    metrics = run_ranks(train_worker, 2, cfg, timeout_s=600)[0]["metrics"]
    steps = [m for m in metrics if "staleness/max" in m]
    assert [m["staleness/max"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    assert steps[0]["mismatch/abs_logprob_max"] < 1e-4, steps[0]
    assert all(m["mismatch/abs_logprob_max"] > 1e-4 for m in steps[1:]), steps  # behaviour = previous weights
    for m in steps:
        assert all(v == v and abs(v) != float("inf") for v in m.values() if isinstance(v, float)), m


def test_async_rollouts_reject_colocated_servers(tmp_path, warm_cache):
    from megatron_kl.config import ConfigError, from_dict
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig
    from tests.e2e.runs import short_config

    cfg = from_dict(
        TrainConfig,
        short_config(
            tmp_path,
            warm_cache,
            "rollout.engine=sglang",
            "train.staleness=2",
            "rollout.sglang.colocated=true",
            "rollout.sglang.enable_memory_saver=true",
        ),
    )
    with pytest.raises(ConfigError, match="rollout.sglang.colocated=false"):
        validate_train_config(cfg, cfg.model.vocab_size, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["from_disk", "from_tensor", "from_distributed"])
def test_real_sglang_server_generates_and_syncs(tmp_path, models, sync):
    """The same client against real SGLang (GPU machines with `pip install -e .[sglang]`)."""
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("real SGLang needs a GPU")
    config = SGLangConfig(
        port=server_port(),
        weight_sync=sync,
        sync_dir=str(tmp_path / "sync"),
        mem_fraction_static=0.3,
        startup_timeout_s=600,
    )
    weight_sync = {
        "from_disk": lambda: FromDisk(config, _model(models["a"])),
        "from_tensor": lambda: FromTensor(config),
        "from_distributed": lambda: FromDistributed(config),
    }[sync]()
    engine = SGLangEngine(config, weight_sync, str(models["a"]), log_dir=tmp_path / "logs")
    try:
        engine.update_weights(_hf_tensors(models["b"]), 1)
        got = engine.generate(PROMPTS, SAMPLING, seed=0)
        assert len(got) == len(PROMPTS) and {c.weight_version for c in got} == {1}
    finally:
        engine.shutdown()


def test_corrupt_values_are_retried_like_a_5xx_without_loss(tmp_path, models, clean):
    """NaN / +inf / positive log-probs, ids outside the vocabulary, too many tokens and empty completions
    (the test server's --fault-corrupt-every cycles through them) are retried; the result equals a clean run."""
    from megatron_kl.testing.corruptions import CORRUPTIONS

    clean.update_weights(_hf_tensors(models["a"]), 5)
    want = clean.generate(PROMPTS, SAMPLING, seed=22)
    engine = _engine(tmp_path, models["a"], "--fault-corrupt-every", "2", max_concurrency=1, max_retries=3)
    engine.vocab_size = _model(models["a"]).vocab_size
    try:
        engine.update_weights(_hf_tensors(models["a"]), 5)
        got = engine.generate(PROMPTS, SAMPLING, seed=22)
        _same(got, want)
        assert engine.counters["retries"] >= len(CORRUPTIONS) and engine.counters["restarts"] == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("sync", ["from_disk", "from_tensor"])
def test_server_dying_during_a_weight_update_is_restarted_and_updated(tmp_path, models, clean, sync):
    """The 2nd weight update kills the server before it answers: the engine restarts it (back at the
    committed version 1 = model a), pushes version 2 (model b) again and records version 2 only then;
    generation then serves model b labelled 2, exactly as a server that never died."""
    clean.update_weights(_hf_tensors(models["b"]), 7)
    want = clean.generate(PROMPTS, SAMPLING, seed=51)
    engine = _engine(
        tmp_path,
        models["a"],
        "--fault-exit-on-update",
        "2",
        "--fault-marker",
        str(tmp_path / "died"),
        sync=sync,
        max_retries=1,
    )
    try:
        engine.update_weights(_hf_tensors(models["a"]), 1)
        committed = engine.sync.committed
        engine.update_weights(_hf_tensors(models["b"]), 7)
        assert (tmp_path / "died").exists() and engine.counters["restarts"] == 1
        assert engine.weight_version == 7 and engine.sync.version == 7 and engine.sync.committed is not committed
        _same(engine.generate(PROMPTS, SAMPLING, seed=51), want)
        if sync == "from_disk":  # the version it replaced is gone; nothing else under sync_dir was touched
            assert not committed.exists() and engine.sync.committed.exists()
    finally:
        engine.shutdown()


def test_weight_sync_retention_touches_only_the_runs_own_versions(tmp_path, models):
    user_dir = tmp_path / "sync" / "version_000001_user_notes"
    user_dir.mkdir(parents=True)
    engine = _engine(tmp_path, models["a"])
    try:
        for version in (1, 2, 3):
            engine.update_weights(_hf_tensors(models["a"]), version)
        assert user_dir.exists()
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["version_000001_user_notes", "version_000003"]
    finally:
        engine.shutdown()


def test_managed_servers_get_a_per_engine_api_key(tmp_path, models, monkeypatch):
    """/update_weights_from_tensor unpickles its input: managed servers run with --api-key (a fresh key per
    engine, or the one in rollout.sglang.api_key_env); requests without it get 401."""
    import requests

    monkeypatch.delenv("MEGATRON_KL_SGLANG_API_KEY", raising=False)
    engine = _engine(tmp_path, models["a"])
    try:
        assert engine.api_key and len(engine.api_key) == 32
        assert "--api-key" in engine.servers[0].command
        engine.update_weights(_hf_tensors(models["a"]), 1)
        assert len(engine.generate(PROMPTS[:2], SAMPLING, seed=1)) == 2
        anonymous = requests.post(engine.urls[0] + "/generate", json={"input_ids": [1, 2]}, timeout=30)
        assert anonymous.status_code == 401
        assert requests.get(engine.urls[0] + "/health", timeout=30).status_code == 200
        from megatron_kl.rollout.http import ServerError, call, new_session

        wrong = new_session(headers={"Authorization": "Bearer not-the-key"})
        with pytest.raises(ServerError, match="refused the trainer's API key.*rollout.sglang.api_key_env"):
            call(engine.urls[0], "/generate", {"input_ids": [1, 2]}, session=wrong)
    finally:
        engine.shutdown()
    log = (tmp_path / "logs" / "sglang-0.log").read_text()
    assert "--api-key <redacted>" in log and engine.api_key not in log  # a secret never reaches a log


def test_given_urls_are_waited_for_until_healthy(tmp_path, models):
    """rollout.sglang.urls (servers of a Slurm het job start with the trainer): the engine waits for every
    server's /health within startup_timeout_s, and names the URL and the setting when one never answers."""
    import subprocess
    import threading
    import time

    import requests

    port = server_port()
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match=rf"{url} did not answer GET /health .*startup_timeout_s=1s"):
        SGLangEngine(SGLangConfig(urls=[url], startup_timeout_s=1), FromTensor(SGLangConfig()))
    assert time.monotonic() - start >= 1
    started = {}

    def start_late():
        time.sleep(2)
        started["proc"] = subprocess.Popen(
            [sys.executable, "-m", TEST_SERVER, "--model-path", str(models["a"]), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    late = threading.Thread(target=start_late)
    start = time.monotonic()
    late.start()
    try:
        engine = SGLangEngine(SGLangConfig(urls=[url], startup_timeout_s=120), FromTensor(SGLangConfig()))
        assert time.monotonic() - start >= 2  # it waited for the late server
        assert requests.get(url + "/health", timeout=10).status_code == 200
        engine.shutdown()
    finally:
        late.join()
        started["proc"].kill()
        started["proc"].wait()


def test_managed_servers_skip_ports_in_use_and_a_port_taken_while_starting(tmp_path, models, monkeypatch):
    """rollout.sglang.port is where managed servers start counting: a port already in use is skipped, and a port
    another socket takes between the check and the server's bind (injected: the check is told it is free) fails
    that start only - the next free port is tried. The engine's URLs are where the servers really listen."""
    import socket

    import requests

    from megatron_kl.rollout import servers

    first = server_port()
    with socket.socket() as holder:  # someone else listens on the configured port
        holder.bind(("127.0.0.1", first))
        holder.listen()
        engine = _engine(tmp_path / "skip", models["a"], port=first, num_servers=2)
        try:
            ports = [int(url.rsplit(":", 1)[1]) for url in engine.urls]
            assert ports[0] > first and ports[1] > ports[0]
            assert all(requests.get(url + "/health", timeout=10).status_code == 200 for url in engine.urls)
        finally:
            engine.shutdown()

        truthful = servers.port_available
        lied = []

        def racy(host, port):  # the held port looks free once: the race of a check before a bind
            if port == first and not lied:
                lied.append(port)
                return True
            return truthful(host, port)

        monkeypatch.setattr(servers, "port_available", racy)
        engine = _engine(tmp_path / "race", models["a"], port=first)
        try:
            assert lied == [first]
            log = (tmp_path / "race" / "logs" / "sglang-0.log").read_text()
            assert log.count("==== start") == 2 and "Address already in use" in log
            assert int(engine.urls[0].rsplit(":", 1)[1]) > first
            engine.update_weights(_hf_tensors(models["a"]), 1)
            assert len(engine.generate(PROMPTS[:2], SAMPLING, seed=1)) == 2
        finally:
            engine.shutdown()


def test_a_managed_server_that_fails_on_a_free_port_is_not_retried(tmp_path, models):
    """A start that fails while its port stays free is the server's own failure (here: a module that does not
    exist): one attempt, a permanent error (no requeue: the trainer exits 1) carrying the server's log tail."""
    from megatron_kl.rollout.servers import ServerStartFailed

    with pytest.raises(ServerStartFailed, match=r"(?s)exited with code 1 while starting.*No module named"):
        _engine(tmp_path, models["a"], server_module="megatron_kl.testing.no_such_server")
    assert (tmp_path / "logs" / "sglang-0.log").read_text().count("==== start") == 1


def _truncated_logprobs(model, completion, sampling):
    """log mu of the sampled tokens from the HF model: the tempered logits truncated by the engines' rule."""
    from megatron_kl.rollout.local import filter_logits

    tokens = torch.tensor([completion.prompt_ids + completion.response_ids])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(completion.prompt_ids) - 1 : -1].double() / sampling.temperature
    filtered = filter_logits(logits, sampling.top_k, sampling.top_p)
    ids = torch.tensor(completion.response_ids)[:, None]
    return torch.log_softmax(filtered, -1).gather(-1, ids)[:, 0], torch.isfinite(filtered.gather(-1, ids)[:, 0])


@pytest.mark.parametrize("top_k, top_p", [(8, 1.0), (0, 0.8), (12, 0.9)], ids=["top-k", "top-p", "both"])
def test_truncated_sampling_reports_the_processed_logprobs(clean, models, top_k, top_p):
    """SGLang answers log softmax(z / T) of the full distribution (its sampler takes them before the top-k /
    top-p renormalisation; so does the test server): the client asks for the top log-probs and reports log mu of
    the truncated distribution, every sampled token inside the support."""
    from transformers import AutoModelForCausalLM

    clean.update_weights(_hf_tensors(models["a"]), 1)
    clean.vocab_size = _model(models["a"]).vocab_size
    model = AutoModelForCausalLM.from_pretrained(models["a"], dtype=torch.float32).eval()
    sampling = SamplingConfig(temperature=0.8, top_k=top_k, top_p=top_p, max_new_tokens=6, stop_token_ids=[0])
    truncated_away = 0.0
    for completion in clean.generate(PROMPTS, sampling, seed=4):
        expected, inside = _truncated_logprobs(model, completion, sampling)
        assert bool(inside.all()), completion
        got = torch.tensor(completion.response_logprobs, dtype=torch.float64)
        assert torch.allclose(got, expected, atol=2e-4), (got, expected)
        tokens = torch.tensor([completion.prompt_ids + completion.response_ids])
        with torch.no_grad():
            full = torch.log_softmax(model(tokens).logits[0, len(completion.prompt_ids) - 1 : -1].double() / 0.8, -1)
        truncated_away = max(
            truncated_away, float((got - full.gather(-1, torch.tensor(completion.response_ids)[:, None])[:, 0]).max())
        )
    assert truncated_away > 1e-3  # the processed log-probs are not the full distribution's


def test_a_sampled_token_outside_the_support_is_retried_and_named(tmp_path, models, clean):
    """--fault-off-support-every: a response whose token lies outside the top-k support is a corrupt answer,
    retried like a 5xx (the result equals a clean run); one that always does names the position."""
    from megatron_kl.rollout.http import CorruptResponse
    from megatron_kl.rollout.sglang_protocol import processed_logprobs

    sampling = SamplingConfig(temperature=1.0, top_k=5, max_new_tokens=6, stop_token_ids=[0])
    clean.update_weights(_hf_tensors(models["a"]), 5)
    clean.vocab_size = _model(models["a"]).vocab_size
    want = clean.generate(PROMPTS[:4], sampling, seed=9)
    engine = _engine(tmp_path, models["a"], "--fault-off-support-every", "2", max_concurrency=1, max_retries=3)
    engine.vocab_size = clean.vocab_size
    try:
        engine.update_weights(_hf_tensors(models["a"]), 5)
        _same(engine.generate(PROMPTS[:4], sampling, seed=9), want)
        assert engine.counters["retries"] >= 2
    finally:
        engine.shutdown()
    top = [[[-0.5, 3, None], [-1.5, 4, None]]]
    with pytest.raises(CorruptResponse, match="position 0"):
        processed_logprobs([-9.0], [7], top, SamplingConfig(top_k=2), 2, "server")
    with pytest.raises(ResponseError, match="rollout.sglang.top_logprobs_num"):  # top-p support beyond the top 2
        processed_logprobs([-0.5], [3], top, SamplingConfig(top_p=0.95), 2, "server")
