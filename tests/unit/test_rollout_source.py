"""Async rollouts scored off the main thread: math-verify (whose own timeouts use signal.alarm, main thread only)
scores in the background generation thread and the reward workers (staleness >= 1) as in the main thread."""

import json
import threading

import pytest
import torch

from megatron_kl.rollout.engine import Completion, EngineBase
from megatron_kl.tasks.math import MathConfig, MathTask
from megatron_kl.train.rollouts import RolloutSource
from tests.unit.test_tasks import _tiny_hf_tokenizer


class _BoxedAnswerEngine(EngineBase):
    """Answers every prompt with the right boxed answer; records the generating thread."""

    def __init__(self, task):
        self.task, self.threads = task, set()

    def generate(self, prompts, sampling, seed=None):
        self.threads.add(threading.current_thread().name)
        answers = {
            tuple(self.task.problem("train", i).prompt_ids): self.task.problem("train", i).answer
            for i in range(len(self.task.splits["train"]))
        }
        out = []
        for prompt in prompts:
            ids = self.task.tokenizer.encode("The answer is \\boxed{%s}." % answers[tuple(prompt)])
            out.append(Completion(prompt, ids, [-0.5] * len(ids), "stop", 0))
        return out


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_math_scoring_with_async_rollouts(tmp_path, staleness):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"What is {i}+{i}?", "answer": str(2 * i)}) for i in range(6)))
    task = MathTask(MathConfig(train_files=[str(path)]), tokenizer=_tiny_hf_tokenizer())
    engine = _BoxedAnswerEngine(task)
    source = RolloutSource(task, engine, sampling=None, prompts_per_step=2, group_size=2, staleness=staleness, seed=0)
    try:
        for step in range(4):
            batch = source.get(step)
            assert batch.step == step and batch.rewards.tolist() == [1.0] * 4
        state = source.state_dict()  # queued batches are scored before checkpointing
        assert sorted(state["queue"]) == list(range(4, 4 + staleness))
        assert all(b["rewards"].tolist() == [1.0] * 4 for b in state["queue"].values())
    finally:
        source.close()
    if staleness:
        assert any(name.startswith("rollout") for name in engine.threads)  # generation did run in the background


CLEAN_BODY = {
    "output_ids": [5, 7, 0],
    "meta_info": {
        "finish_reason": {"type": "stop", "matched": 0},
        "weight_version": "3",
        "output_token_logprobs": [[-0.5, 5, None], [-1.25, 7, None], [-0.01, 0, None]],
    },
}


@pytest.mark.parametrize(
    "kind, message",
    [
        ("nan", "log-prob nan at response position 0"),
        ("inf", "log-prob inf at response position 0"),
        ("positive", "log-prob 0.5 at response position 0"),
        ("oov", "token id 53 at position 0 is outside"),
        ("negative", "token id -1 at position 0"),
        ("too_long", "more than rollout.sampling.max_new_tokens=6"),
        ("empty", "no output_ids"),
    ],
)
def test_sglang_response_with_impossible_values_is_a_corrupt_response(kind, message):
    import copy

    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.http import CorruptResponse
    from megatron_kl.rollout.sglang_protocol import parse_generate
    from megatron_kl.testing.corruptions import corrupt

    sampling = SamplingConfig(max_new_tokens=6)
    ok = parse_generate(copy.deepcopy(CLEAN_BODY), [1, 2], 3, "http://s:1 prompt 0", sampling, vocab_size=50)
    assert ok.response_ids == [5, 7, 0]
    with pytest.raises(CorruptResponse, match=message) as err:
        parse_generate(
            corrupt(copy.deepcopy(CLEAN_BODY), kind, 50), [1, 2], 3, "http://s:1 prompt 0", sampling, vocab_size=50
        )
    assert "http://s:1 prompt 0" in str(err.value)


def _routed_body(ids):
    import copy

    from megatron_kl.testing.sglang_server import encode_routed_experts

    body = copy.deepcopy(CLEAN_BODY)
    body["meta_info"].update(prompt_tokens=2, completion_tokens=3, routed_experts=encode_routed_experts(ids))
    return body


@pytest.mark.parametrize(
    "kind, message",
    [
        ("short", r"shape \(3, 2, 2\), expected \(4, 2, 2\)"),
        ("out_of_range", "position 0, layer 0 are \\[8, "),
        ("repeated", "not 2 distinct ids"),
        ("missing", "return_routed_experts=true was sent"),
        ("not_base64", "not valid base64"),
        ("ragged_bytes", "not a whole number of tokens"),
    ],
)
def test_sglang_routed_experts_are_decoded_and_checked(kind, message):
    """SGLang's meta_info.routed_experts (base64 int32 [prompt + output - 1, layers, top-k]) becomes the completion's
    routing; a routing of another length, an id past the experts, an expert twice in one token's top-k, a missing
    or undecodable field are a CorruptResponse naming it (retried like a 5xx)."""
    import base64

    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.http import CorruptResponse
    from megatron_kl.rollout.sglang_protocol import RoutingShape, parse_generate
    from megatron_kl.testing.corruptions import corrupt_routing

    shape = RoutingShape(num_layers=2, router_topk=2, num_experts=8)
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(8)]).view(
        4, 2, 2
    )
    ok = parse_generate(_routed_body(ids), [1, 2], 3, "http://s:1 prompt 0", SamplingConfig(), 50, routing=shape)
    assert torch.equal(ok.routed_experts.long(), ids)
    body = _routed_body(ids)
    meta = body["meta_info"]
    if kind in ("short", "out_of_range", "repeated"):
        corrupt_routing(meta, kind, shape.num_experts)
    elif kind == "missing":
        del meta["routed_experts"]
    elif kind == "not_base64":
        meta["routed_experts"] = "%%%"
    else:
        meta["routed_experts"] = base64.b64encode(b"\x01\x00\x00\x00" * 5).decode()
    with pytest.raises(CorruptResponse, match=message) as err:
        parse_generate(body, [1, 2], 3, "http://s:1 prompt 0", SamplingConfig(), 50, routing=shape)
    assert "http://s:1 prompt 0" in str(err.value)


def test_sglang_empty_200_body_is_retried_not_fatal():
    """A server dying mid-answer can leave a 200 with no body: corrupt (retried), not a malformed reply."""
    from megatron_kl.rollout.http import CorruptResponse
    from megatron_kl.rollout.sglang_protocol import ResponseError, parse_generate

    with pytest.raises(CorruptResponse, match="empty body"):
        parse_generate(None, [1, 2], 3, "http://s:1 prompt 0")
    with pytest.raises(ResponseError, match="answered list"):
        parse_generate([], [1, 2], 3, "http://s:1 prompt 0")


@pytest.mark.parametrize(
    "tokens, logprobs, message",
    [
        (["token_id:5"], [float("nan")], "log-prob nan"),
        (["token_id:99"], [-0.1], "token id 99"),
        (["token_id:5"], [0.3], "log-prob 0.3"),
    ],
)
def test_vllm_server_response_with_impossible_values_is_a_corrupt_response(tokens, logprobs, message):
    from megatron_kl.config import ModelConfig
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.http import CorruptResponse
    from megatron_kl.rollout.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # the parser only: no server
    engine.cfg = type("Cfg", (), {"url": "http://v:2"})()
    engine.model, engine.weight_version = ModelConfig(vocab_size=50), 0
    body = {"choices": [{"finish_reason": "stop", "logprobs": {"tokens": tokens, "token_logprobs": logprobs}}]}
    with pytest.raises(CorruptResponse, match=message):
        engine._parse_completion(body, [1], SamplingConfig(max_new_tokens=4))


def test_call_retries_a_corrupt_body_then_gives_up_naming_it(monkeypatch):
    import requests

    from megatron_kl.rollout.http import CorruptResponse, RetryPolicy, ServerUnavailable, call

    class Response:
        status_code, content, text, headers, raw = 200, b"{}", "{}", {}, None

        def json(self):
            return {}

        def close(self):
            pass

    calls = []
    monkeypatch.setattr(requests.Session, "request", lambda self, *a, **k: calls.append(1) or Response())

    def parse(body):
        raise CorruptResponse("http://x: behaviour log-prob nan at response position 0")

    with pytest.raises(ServerUnavailable, match="log-prob nan"):
        call("http://x", "/generate", {}, RetryPolicy(max_retries=2, backoff_s=0.0), parse=parse)
    assert len(calls) == 3


@pytest.mark.parametrize(
    "answer",
    [
        {"results": [{"error": "shape mismatch"}]},
        {"results": ["Error: no file"]},
        {"detail": "not found"},
        ["unexpected"],
    ],
)
def test_vllm_reload_reporting_an_error_in_a_200_body_keeps_the_version(monkeypatch, tmp_path, answer):
    from megatron_kl.config import ModelConfig
    from megatron_kl.rollout import vllm
    from megatron_kl.rollout.http import ServerError

    engine = vllm.VLLMEngine.__new__(vllm.VLLMEngine)
    engine.cfg = type("Cfg", (), {"url": "http://v:2", "sync_dir": str(tmp_path)})()
    engine.model, engine.weight_version, engine.asleep, engine.llm = ModelConfig(vocab_size=50), 3, False, None
    engine.policy, engine.delta, engine.last_sync = None, None, None
    monkeypatch.setattr(vllm.VLLMEngine, "_write", lambda self, named, version: str(tmp_path / "v"))
    monkeypatch.setattr(vllm, "call", lambda url, path, payload, policy, *a, **k: answer)
    with pytest.raises(ServerError, match="collective_rpc"):
        engine.update_weights([], 4)
    assert engine.weight_version == 3
    for ok in ({"results": [None]}, None):  # None: vLLM's empty 200 when the RPC returned None
        monkeypatch.setattr(vllm, "call", lambda url, path, payload, policy, *a, **k: ok)
        engine.update_weights([], 4)
        assert engine.weight_version == 4


def test_a_reward_that_is_not_finite_is_an_error_naming_task_and_sample(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"What is {i}+{i}?", "answer": str(2 * i)}) for i in range(4)))

    class NaNScores(MathTask):
        def score(self, problem, response_ids):
            return float("nan") if problem.answer == "2" else 1.0

    task = NaNScores(MathConfig(train_files=[str(path)]), tokenizer=_tiny_hf_tokenizer())
    source = RolloutSource(
        task, _BoxedAnswerEngine(task), sampling=None, prompts_per_step=4, group_size=2, staleness=0, seed=0
    )
    from megatron_kl.rewards.scorer import RewardFailed

    with pytest.raises(
        RewardFailed,
        match=r"NaNScores.score failed on sample \d \(prompt \d: 'What is 1\+1\?', answer "
        r"'2'\): reward nan is not finite",
    ):
        source.get(0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_every_estimator_clamps_an_infinite_log_ratio(estimator):
    import torch

    from megatron_kl.kl.estimators import ClampCounter, token_estimate

    log_ratio = torch.tensor([[0.1, float("inf"), -float("inf")]], requires_grad=True)
    counter = ClampCounter()
    value = token_estimate(estimator, log_ratio, 20.0, torch.ones(1, 3), counter)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(log_ratio.grad).all()
    assert counter.counts[estimator] == 2


def test_completion_refuses_an_unknown_finish_reason_and_mismatched_logprobs():
    """A Completion is checked when built: finish_reason is stop, length or abort (a paused partial response), one
    log-prob and (when given) one weight version per response token."""
    with pytest.raises(ValueError, match="finish_reason='cancelled'; expected one of"):
        Completion([1, 2], [5], [-0.5], "cancelled", 0)
    assert not Completion([1, 2], [5], [-0.5], "abort", 0).finished
    with pytest.raises(ValueError, match="1 response ids but 2 token versions"):
        Completion([1, 2], [5], [-0.5], "stop", 3, token_versions=[2, 3])
    with pytest.raises(ValueError, match="1 response ids but 2 log-probs"):
        Completion([1, 2], [5], [-0.5, -0.1], "stop", 0)
    assert Completion([1, 2], [5, 7], [-0.5, -0.1], "length", 0).routed_positions == 3


def test_sglang_routing_of_a_model_with_dense_first_layers_skips_their_slots():
    """DeepSeek-V3's first layers have no router: SGLang leaves their slots as zeros (one expert twice in a top-k),
    which are not refused and read as unknown; an impossible id in a routed layer still is, naming that layer."""
    from megatron_kl.models.routing_replay import UNKNOWN
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.http import CorruptResponse
    from megatron_kl.rollout.sglang_protocol import RoutingShape, parse_generate

    shape = RoutingShape(num_layers=3, router_topk=2, num_experts=8, dense_layers=1)
    routed = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(8)])
    ids = torch.cat([torch.zeros(4, 1, 2, dtype=torch.long), routed.view(4, 2, 2)], dim=1)
    ok = parse_generate(_routed_body(ids), [1, 2], 3, "http://s:1 prompt 0", SamplingConfig(), 50, routing=shape)
    assert (ok.routed_experts[:, 0] == UNKNOWN).all() and torch.equal(ok.routed_experts[:, 1:].long(), ids[:, 1:])
    ids[2, 2, 1] = 9
    with pytest.raises(CorruptResponse, match="position 2, layer 2 are"):
        parse_generate(_routed_body(ids), [1, 2], 3, "http://s:1 prompt 0", SamplingConfig(), 50, routing=shape)
