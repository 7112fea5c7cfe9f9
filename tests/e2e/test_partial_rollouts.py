"""Partial rollouts: generations paused at a weight update and resumed with the new weights keep, per token, the
weights that sampled it. The embedded engine (TP=1 and TP=2), the SGLang client against the test server's
pause (mode abort), and a training run whose responses span weight versions."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_kl.rollout.engine import PAUSED, SamplingConfig
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.rollouts import _Generated, _resume
from tests.e2e.test_engine import MODEL, PROMPTS
from tests.e2e.workers import partial_engine_worker

SAMPLING = {"temperature": 0.7, "max_new_tokens": 9, "stop_token_ids": [2, 3]}


def _assert_each_token_from_its_version(out, tolerance=1e-5):
    """Every response token's behaviour log-prob is the one the trainer computes for that prefix with the weights of
    the version it is tagged with."""
    mask = out["mask"]
    for row, completion in enumerate(out["done"]):
        start = len(completion.prompt_ids) - 1
        for t, (version, logprob) in enumerate(zip(completion.versions, completion.response_logprobs)):
            assert mask[row, start + t] == 1
            expected = float(out["logprobs"][version][row, start + t])
            assert abs(logprob - expected) < tolerance, (row, t, version, logprob, expected)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_paused_generation_resumes_with_the_new_weights_token_for_token(tp):
    """Paused after 3 tokens (the 4th token boundary check), resumed from prompt + partial response with other
    weights: the first tokens keep version 1 and their log-probs under it, the rest are version 2's (< 1e-5 of the
    trainer's recomputation at each prefix); TP=2 draws what TP=1 draws."""
    outs = run_ranks(partial_engine_worker, tp, MODEL, tp, PROMPTS, SAMPLING, 4)
    reference = run_ranks(partial_engine_worker, 1, MODEL, 1, PROMPTS, SAMPLING, 4)[0] if tp > 1 else outs[0]
    for out in outs:
        paused = [c for c in out["first"] if c.finish_reason == PAUSED]
        assert paused, "no response was still being generated at the pause"
        assert all(len(c.response_ids) == 3 for c in paused)
        for first, done in zip(out["first"], out["done"]):
            assert done.finished and len(done.response_ids) <= SAMPLING["max_new_tokens"]
            assert done.response_ids[: len(first.response_ids)] == first.response_ids
            assert done.response_logprobs[: len(first.response_ids)] == first.response_logprobs
            if first.finish_reason == PAUSED:
                assert done.versions == [1] * 3 + [2] * (len(done.response_ids) - 3)
                assert done.weight_version == 2
            else:
                assert done.versions == [1] * len(done.response_ids) and done.token_versions is None
            stops = [i for i, t in enumerate(done.response_ids) if t in (2, 3)]
            assert not stops or stops == [len(done.response_ids) - 1]
        assert any(len(set(c.versions)) == 2 for c in out["done"])
        _assert_each_token_from_its_version(out)
        assert [c.response_ids for c in out["done"]] == [c.response_ids for c in reference["done"]]


def test_a_pause_before_generation_begins_leaves_every_token_to_the_new_weights():
    out = run_ranks(partial_engine_worker, 1, MODEL, 1, PROMPTS, SAMPLING, 1)[0]
    assert all(c.finish_reason == PAUSED and not c.response_ids for c in out["first"])
    assert all(set(c.versions) == {2} and c.finished for c in out["done"])
    _assert_each_token_from_its_version(out)


# -- the SGLang client against the test server ----------------------------------------------------------------------


def test_sglang_pause_cuts_requests_in_flight_and_they_resume_with_the_pushed_weights(tmp_path):
    """With --token-latency-s the test server's tokens come out one at a time; the client's pause (/pause_generation
    mode abort) cuts the requests in flight, which come back with their partial output (finish_reason abort), and
    requests not yet sent come back empty. Resumed after model b is pushed as version 2, each token's log-prob is the
    model's (HF transformers) tempered log-softmax at that prefix under the version it is tagged with."""
    from transformers import AutoModelForCausalLM

    from tests.e2e.test_sglang import PROMPTS as SERVED_PROMPTS  # noqa: F401
    from tests.e2e.test_sglang import _engine, _hf_tensors

    root = tmp_path / "hf"
    from hf_workers import make_hf_model

    dirs = {name: make_hf_model("qwen2", root / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}
    engine = _engine(tmp_path, dirs["a"], "--token-latency-s", "0.15", max_concurrency=6)
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=12, stop_token_ids=[])
    try:
        engine.update_weights(_hf_tensors(dirs["a"]), 1)
        result = {}

        def generate():
            try:
                result["first"] = engine.generate(SERVED_PROMPTS, sampling, seed=3)
            except BaseException as err:  # noqa: BLE001 - reported below
                result["error"] = err

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(0.8)
        engine.pause()
        worker.join(timeout=30)
        assert "error" not in result, result.get("error")
        first = result["first"]
        assert all(c.finish_reason == PAUSED for c in first)
        assert any(c.response_ids for c in first), "nothing was out at the pause"
        assert any(not c.response_ids for c in first), "every request was sent before the pause (max_concurrency=6)"
        engine.update_weights(_hf_tensors(dirs["b"]), 2)
        engine.resume()
        done = _resume(engine, _Generated(0, [], SERVED_PROMPTS, first, 0.0, seed=3), sampling).completions
    finally:
        engine.shutdown()
    for before, after in zip(first, done):
        assert after.finished and len(after.response_ids) == sampling.max_new_tokens
        assert after.response_ids[: len(before.response_ids)] == before.response_ids
        assert after.versions == [1] * len(before.response_ids) + [2] * (12 - len(before.response_ids))
    hf = {
        v: AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32).eval()
        for v, name in ((1, "a"), (2, "b"))
    }
    worst = 0.0
    for completion in done:
        tokens = torch.tensor([completion.prompt_ids + completion.response_ids])
        for version, model in hf.items():
            with torch.no_grad():
                logits = model(tokens).logits[0, len(completion.prompt_ids) - 1 : -1] / 0.8
            expected = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(completion.response_ids)[:, None])
            for t, (tagged, logprob) in enumerate(zip(completion.versions, completion.response_logprobs)):
                if tagged == version:
                    worst = max(worst, abs(logprob - float(expected[t, 0])))
    assert worst < 2e-4, worst  # the server's float32 forward against transformers' (the existing check's bound)


def test_training_with_partial_rollouts_on_sglang_servers(tmp_path, warm_cache):
    """train.staleness=2 with rollout.partial on the test server, the responses of one prompt in 3 running to
    max_new_tokens=12 at 0.25 s a token (3 s, longer than a step): the weight update after each step cuts the batches
    in flight, and they finish with the next weights. Responses span versions, every token is at most 2 updates old, and step 0 (generated whole before the
    first update) is on-policy."""
    from megatron_kl.rollout.servers import server_port
    from tests.e2e.runs import short_config
    from tests.e2e.test_sglang import TEST_SERVER
    from tests.e2e.workers import train_worker

    cfg = short_config(
        tmp_path / "run",
        warm_cache,
        "rollout.engine=sglang",
        "rollout.sglang.weight_sync=from_disk",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        "rollout.sglang.extra_args=[--token-latency-s, '0.25', --long-every, '3']",
        "rollout.sampling.max_new_tokens=12",
        "rollout.partial=true",
        "train.staleness=2",
        "train.steps=4",
        "kl.estimator=k3",
        "kl.placement=loss",
        "kl.off_policy=token_is",
        "task.eval_size=2",
        "eval.k=1",
        "eval.max_new_tokens=1",
    )  # evaluation: not what is tested
    metrics = run_ranks(train_worker, 1, cfg, timeout_s=600)[0]["metrics"]
    steps = [m for m in metrics if "staleness/token_max" in m]
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    assert steps[0]["staleness/token_max"] == 0 and steps[0]["mismatch/abs_logprob_max"] < 1e-4
    assert all(m["staleness/token_max"] <= 2 for m in steps)
    assert sum(m["staleness/mixed_response_fraction"] for m in steps) > 0, steps
    mixed = [m for m in steps if m["staleness/mixed_response_fraction"] > 0]
    assert all(0 < m["staleness/older_token_fraction"] <= 1 for m in mixed)
    for m in steps:
        assert all(v == v and abs(v) != float("inf") for v in m.values() if isinstance(v, float)), m


def test_a_server_that_cannot_pause_is_refused_at_start_naming_the_field(tmp_path):
    from hf_workers import make_hf_model

    import tests.e2e.test_sglang  # noqa: F401 - puts tests/distributed on the path
    from megatron_kl.rollout.config import SGLangConfig
    from megatron_kl.rollout.servers import server_port
    from megatron_kl.rollout.sglang import SGLangEngine
    from megatron_kl.rollout.sglang_sync import FromTensor
    from tests.e2e.test_sglang import TEST_SERVER

    model_dir = make_hf_model("qwen2", tmp_path / "a", seed=0)
    config = SGLangConfig(
        server_module=TEST_SERVER,
        port=server_port(),
        extra_args=["--no-pause-routes"],
        startup_timeout_s=120,
        weight_sync="from_tensor",
    )
    with pytest.raises(ValueError, match="rollout.partial=true: .* cannot pause and continue generation"):
        SGLangEngine(config, FromTensor(config), str(model_dir), log_dir=tmp_path / "logs", partial=True)
    import subprocess

    left = subprocess.run(["pgrep", "-f", f"--model-path {model_dir}"], capture_output=True, text=True).stdout
    assert not left.strip(), f"the refused engine left its server running: {left}"  # stopped with the refusal


def test_training_with_partial_rollouts_on_the_embedded_engine(tmp_path, warm_cache):
    """The embedded engine with rollout.partial and staleness 2: the run finishes, step 0 is on-policy, and whatever
    the pauses cut (their timing is the machine's), every token is at most 2 updates old and the per-token metrics
    are consistent."""
    from tests.e2e.runs import short_config
    from tests.e2e.workers import train_worker

    cfg = short_config(
        tmp_path / "run",
        warm_cache,
        "rollout.partial=true",
        "train.staleness=2",
        "train.steps=4",
        "rollout.sampling.max_new_tokens=12",
        "kl.estimator=k3",
        "kl.placement=loss",
        "kl.off_policy=token_is",
    )
    metrics = run_ranks(train_worker, 1, cfg, timeout_s=600)[0]["metrics"]
    steps = [m for m in metrics if "staleness/token_max" in m]
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    assert steps[0]["staleness/token_max"] == 0 and steps[0]["mismatch/abs_logprob_max"] < 1e-4
    for m in steps:
        assert m["staleness/token_max"] <= 2 and 0 <= m["staleness/older_token_fraction"] <= 1
        assert m["staleness/token_mean"] <= m["staleness/token_max"]
        assert (m["staleness/mixed_response_fraction"] > 0) <= (m["staleness/older_token_fraction"] > 0)
