"""The rollout source with partial rollouts (rollout.partial): a weight update pauses the generations in flight and
resumes them with the new weights; every token keeps the version that sampled it, and the staleness bound holds per
token. Driven by a pausable engine whose tokens come out one per tick and whose log-probs name their version."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_kl.config import ConfigError, from_dict
from megatron_kl.rollout.engine import PAUSED, Completion, EngineBase, SamplingConfig
from megatron_kl.train.rollouts import RolloutSource, StalenessExceeded, _Generated

PROMPT_LEN, STOP, LONG, SHORT = 3, 1, 12, 3


def _logprob(version: int, position: int) -> float:
    return -(version + 1) - position / 100


class _TickEngine(EngineBase):
    """Row k's response is LONG tokens when k % 4 == 0, else SHORT (the last one the stop token); one token per
    ``tick`` for every active row, each with log-prob -(version + 1) - position / 100."""

    def __init__(self, tick: float = 0.01):
        self.tick, self.weight_version, self._paused, self.pauses = tick, 0, threading.Event(), 0

    def pause(self):
        self.pauses += 1
        self._paused.set()

    def resume(self):
        self._paused.clear()

    def update_weights(self, source, version):
        assert self._paused.is_set() or source == "synchronous", "weights changed under a running generation"
        self.weight_version = version

    def generate(self, prompts, sampling, seed=None, budgets=None):
        budgets = budgets or [sampling.max_new_tokens] * len(prompts)
        rows = [{"prompt": list(p), "new": [], "budget": b} for p, b in zip(prompts, budgets)]

        def target(row):
            return LONG if row["prompt"][0] % 4 == 0 else SHORT

        def done(row):
            so_far = len(row["prompt"]) - PROMPT_LEN + len(row["new"])
            return so_far >= target(row) or len(row["new"]) >= row["budget"]

        while not all(done(r) for r in rows) and not self._paused.is_set():
            time.sleep(self.tick)
            for row in rows:
                if not done(row):
                    position = len(row["prompt"]) - PROMPT_LEN + len(row["new"])
                    row["new"].append(STOP if position == target(row) - 1 else 10 + position)
        out = []
        for row in rows:
            start = len(row["prompt"]) - PROMPT_LEN
            finish = ("stop" if row["new"] and row["new"][-1] == STOP else "length") if done(row) else PAUSED
            out.append(
                Completion(
                    row["prompt"],
                    row["new"],
                    [_logprob(self.weight_version, start + t) for t in range(len(row["new"]))],
                    finish,
                    self.weight_version,
                )
            )
        return out


class _Task:
    tokenizer = SimpleNamespace(pad_id=0, decode=lambda ids: "")

    def problem(self, split, index):
        return SimpleNamespace(prompt_ids=[index, 7, 7], answer="", prompt_text="")

    def score(self, problem, response_ids):
        return float(response_ids[-1] == STOP)


def _run(partial: bool, steps: int = 6, staleness: int = 2, train_s: float = 0.06):
    engine = _TickEngine()
    source = RolloutSource(
        _Task(),
        engine,
        SamplingConfig(max_new_tokens=LONG, stop_token_ids=[STOP]),
        prompts_per_step=4,
        group_size=1,
        staleness=staleness,
        seed=0,
        partial=partial,
    )
    batches = []
    try:
        for step in range(steps):
            batches.append(source.get(step))
            time.sleep(train_s)  # training
            with source.weight_update():
                engine.update_weights(None if partial else "synchronous", step + 1)
    finally:
        source.close()
    return batches, engine


def test_responses_span_weight_versions_and_each_token_keeps_its_own():
    batches, engine = _run(partial=True)
    assert engine.pauses == 6
    mixed = 0
    for batch in batches:
        lag = (batch.step - batch.versions)[batch.loss_mask > 0]
        assert int(lag.max()) <= 2 and int(lag.min()) >= 0
        for row, completion in enumerate(batch.completions):
            assert completion.finished and completion.response_ids[-1] == STOP
            assert len(completion.response_ids) == (LONG if completion.prompt_ids[0] % 4 == 0 else SHORT)
            assert completion.response_logprobs == [_logprob(v, t) for t, v in enumerate(completion.versions)]
            mixed += len(set(completion.versions)) > 1
            start = PROMPT_LEN - 1  # the packed batch carries the same per-token versions and log-probs
            n = len(completion.response_ids)
            assert batch.versions[row, start : start + n].tolist() == completion.versions
            assert batch.behavior_logprobs[row, start : start + n].tolist() == pytest.approx(
                completion.response_logprobs
            )
            assert int(batch.weight_versions[row]) == min(completion.versions)
    assert mixed > 0, "no response was resumed across a weight update"


def test_without_partial_rollouts_each_response_has_one_version():
    batches, engine = _run(partial=False)
    assert engine.pauses == 0
    for batch in batches:
        assert all(c.token_versions is None for c in batch.completions)
        assert torch.equal(
            batch.versions[batch.loss_mask > 0],
            batch.weight_versions[:, None].expand_as(batch.loss_mask)[batch.loss_mask > 0],
        )


def test_the_staleness_bound_is_checked_per_token():
    engine = _TickEngine(tick=0.0)
    source = RolloutSource(
        _Task(),
        engine,
        SamplingConfig(max_new_tokens=LONG, stop_token_ids=[STOP]),
        prompts_per_step=1,
        group_size=1,
        staleness=1,
        seed=0,
        partial=True,
    )
    try:
        old = Completion([4, 7, 7], [10, 11], [-1.0, -1.0], "length", 2, token_versions=[0, 2])
        source.queue[3] = _Generated(
            3, [SimpleNamespace(prompt_ids=[4, 7, 7], answer="", prompt_text="")], [[4, 7, 7]], [old], 0.0
        )
        with pytest.raises(StalenessExceeded, match="3 updates old, more than train.staleness=1"):
            source.get(3)
    finally:
        source.close()


def test_a_checkpoint_in_between_holds_only_finished_batches():
    engine = _TickEngine()
    source = RolloutSource(
        _Task(),
        engine,
        SamplingConfig(max_new_tokens=LONG, stop_token_ids=[STOP]),
        prompts_per_step=4,
        group_size=1,
        staleness=2,
        seed=0,
        partial=True,
    )
    try:
        source.get(0)
        with source.weight_update():
            engine.update_weights(None, 1)
        state = source.state_dict()
        assert sorted(state["queue"]) == [1, 2]
        for fields in state["queue"].values():
            assert all(c["finish_reason"] in ("stop", "length") for c in fields["completions"])
        restored = RolloutSource(
            _Task(),
            engine,
            SamplingConfig(max_new_tokens=LONG, stop_token_ids=[STOP]),
            prompts_per_step=4,
            group_size=1,
            staleness=2,
            seed=0,
            partial=True,
        )
        restored.load_state_dict(state)
        assert restored.queue[2].versions.tolist() == source.queue[2].versions.tolist()
        restored.close()
    finally:
        source.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.partial=true"], "train.staleness >= 1"),
        (
            ["rollout.partial=true", "train.staleness=2", "rollout.engine=vllm"],
            "rollout.vllm.mode=llm: that engine cannot pause",
        ),
    ],
)
def test_partial_rollouts_that_cannot_work_are_refused_naming_the_field(tmp_path, overrides, message):
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig
    from tests.e2e.runs import short_config

    cfg = from_dict(TrainConfig, short_config(tmp_path, str(tmp_path / "cache"), *overrides))
    with pytest.raises(ConfigError, match=message):
        validate_train_config(cfg, cfg.model.vocab_size, 1)
