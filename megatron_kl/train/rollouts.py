"""Rollout batches for training steps, on-policy or asynchronous with a staleness bound.

The batch of step t holds ``prompts_per_step / DP`` problems of this data-parallel rank (problem indices
``t * prompts_per_step + i``: the data cursor is the step), each sampled ``group_size`` times with a
seed derived from (seed, step, rank), so a batch is a pure function of the step and the engine weights.

Async (staleness s > 0): at the start of step t the batch for step t + s is submitted to a background
thread, generated from the engine's weights of version t while step t trains; before the next weight
sync the trainer waits for it. The batch used at step t therefore comes from weights of version
max(0, t - s): staleness t - version <= s, logged per sample. The background thread also scores the batch (the
reward calls run while step t trains). Completed queued batches are part of the checkpoint, so a resumed run consumes
exactly the batches the uninterrupted run would have.

Partial rollouts (``rollout.partial``): a weight sync no longer waits for the generations in flight. They are
paused at a token boundary (the engine's ``pause``), the new weights loaded, and every unfinished response continues
from prompt + partial response with them (the engine recomputes the prefix's KV cache), with a seed of its own per
resumption. Every response token keeps the version of the weights that sampled it and its behaviour log-prob under
them (``Completion.token_versions``): the trainer's mu is per token, and a response can span several versions. A
batch for step t + s is started at step t with weights of version t, so every token's staleness is still <= s
(checked per token when the batch is used).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from megatron_kl.rewards.scorer import RewardFailed, RewardScorer, inputs_for, task_reward
from megatron_kl.rollout.engine import Completion, EngineLost, RolloutEngine, SamplingConfig
from megatron_kl.rollout.http import Cancelled, ServerUnavailable
from megatron_kl.train.batching import pack, pack_routing


@dataclass
class RolloutBatch:
    step: int
    completions: list[Completion]
    rewards: torch.Tensor  # [N]
    tokens: torch.Tensor  # [N, S]
    loss_mask: torch.Tensor  # [N, S-1]
    behavior_logprobs: torch.Tensor  # [N, S-1]
    weight_versions: torch.Tensor  # [N]
    generate_seconds: float
    # mixture-of-experts engines that report routing: [N, S, L, k] expert ids per input position (-1: unrouted)
    routed_experts: Optional[torch.Tensor] = None
    # [N, S-1] the weight version that sampled each response token (aligned with loss_mask; 0 elsewhere); None in a
    # batch saved before it existed: every token is its sample's weight_versions entry
    token_versions: Optional[torch.Tensor] = None
    # [N] bool: False for a sample whose reward call failed under reward.on_failure=exclude (its reward is 0, its
    # loss_mask row 0, and it is left out of its group's advantage baseline); None: every sample is valid
    reward_valid: Optional[torch.Tensor] = None
    # the scorer's metrics for this batch (reward/fn/*, reward/extra/*, reward/failed*)
    reward_metrics: dict = field(default_factory=dict)

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def versions(self) -> torch.Tensor:
        """[N, S-1] the behaviour policy's version per position (meaningful where loss_mask is 1)."""
        if self.token_versions is not None:
            return self.token_versions
        return self.weight_versions[:, None].expand_as(self.loss_mask)


def resumed(prefix: Completion, continuation: Completion) -> Completion:
    """``prefix`` (a paused completion) followed by ``continuation`` (generated from prompt + prefix's response): one
    completion whose tokens keep the versions and behaviour log-probs of the weights that sampled them. A routing is
    the prefix's for the positions it fed and the continuation's from there on."""
    fed = list(prefix.prompt_ids) + list(prefix.response_ids)
    if list(continuation.prompt_ids) != fed:
        raise RuntimeError("a resumed generation's prompt is not the paused completion's prompt + response")
    routing = continuation.routed_experts
    if routing is not None and prefix.routed_experts is not None and prefix.response_ids:
        kept = prefix.routed_positions  # the positions the prefix's engine fed: prompt + its response but the last
        routing = torch.cat([prefix.routed_experts[:kept], routing[kept:]])
    versions = prefix.versions + continuation.versions
    return Completion(
        prompt_ids=list(prefix.prompt_ids),
        response_ids=list(prefix.response_ids) + list(continuation.response_ids),
        response_logprobs=list(prefix.response_logprobs) + list(continuation.response_logprobs),
        finish_reason=continuation.finish_reason,
        weight_version=max(versions) if versions else continuation.weight_version,
        routed_experts=routing,
        token_versions=versions if len(set(versions)) > 1 else None,
    )


@dataclass
class _Generated:
    """Completions of one step's prompts, not yet scored. ``_score`` runs where the batch is finished: the background
    thread for an async batch without partial rollouts, else the caller; the reward calls themselves run in the
    scorer's worker threads."""

    step: int
    problems: list
    prompts: list
    completions: list[Completion]
    generate_seconds: float
    seed: int = 0
    segments: int = 1  # generation rounds so far (1 + resumptions)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


def _generate(
    task,
    engine: RolloutEngine,
    step: int,
    prompt_indices: list[int],
    group_size: int,
    sampling: SamplingConfig,
    seed: int,
) -> _Generated:
    problems = [task.problem("train", i) for i in prompt_indices]
    prompts = [p.prompt_ids for p in problems for _ in range(group_size)]
    start = time.perf_counter()
    completions = engine.generate(prompts, sampling, seed=seed)
    seconds = time.perf_counter() - start
    if len(completions) != len(prompts):
        raise RuntimeError(f"engine returned {len(completions)} completions for {len(prompts)} prompts")
    return _Generated(step, problems, prompts, completions, seconds, seed)


def _resume(engine: RolloutEngine, generated: _Generated, sampling: SamplingConfig) -> _Generated:
    """The unfinished completions of ``generated`` continued from prompt + partial response with the engine's current
    weights, in one ``generate`` call (made even when nothing is unfinished here: with several trainer ranks a served
    engine's generate is collective), each with its remaining budget (max_new_tokens - tokens so far) and a seed of
    this resumption's own."""
    start = time.perf_counter()
    completions = list(generated.completions)
    rows, budgets = [], []
    for i, completion in enumerate(completions):
        if completion.finished:
            continue
        budget = sampling.max_new_tokens - len(completion.response_ids)
        if budget <= 0:  # cut exactly at its budget: a finished response
            completions[i] = dataclasses.replace(completion, finish_reason="length")
            continue
        rows.append(i)
        budgets.append(budget)
    prefixes = [list(completions[i].prompt_ids) + list(completions[i].response_ids) for i in rows]
    seed = (generated.seed * 1_000_033 + generated.segments) % (2**62)
    continued = engine.generate(prefixes, sampling, seed=seed, budgets=budgets) if rows or _collective(engine) else []
    if len(continued) != len(rows):
        raise RuntimeError(f"engine returned {len(continued)} completions for {len(rows)} resumed prompts")
    for i, continuation in zip(rows, continued):
        completions[i] = resumed(completions[i], continuation)
    return dataclasses.replace(
        generated,
        completions=completions,
        segments=generated.segments + 1,
        generate_seconds=generated.generate_seconds + time.perf_counter() - start,
    )


def _collective(engine) -> bool:
    """Whether every trainer rank must make each generate call (a served engine behind several ranks)."""
    return engine.collective_generate


def _score(scorer: RewardScorer, task, generated: _Generated, group_size: int) -> RolloutBatch:
    """Rewards (reward.functions through the scorer: concurrent, with reward.on_failure) and the packed batch."""
    completions, prompts, step, seconds = (
        generated.completions,
        generated.prompts,
        generated.step,
        generated.generate_seconds,
    )
    scores = scorer.score(inputs_for(generated.problems, completions, group_size, task.tokenizer))
    rewards = scores.rewards
    tokens, mask, behavior = pack(
        prompts,
        [c.response_ids for c in completions],
        task.tokenizer.pad_id,
        per_token=[c.response_logprobs for c in completions],
    )
    excluded = not bool(scores.valid.all())
    if excluded:  # failed samples (reward.on_failure=exclude): no token of theirs is trained on
        mask = mask * scores.valid[:, None].to(mask.dtype)
    _, _, versions = pack(
        prompts,
        [c.response_ids for c in completions],
        task.tokenizer.pad_id,
        per_token=[c.versions for c in completions],
    )
    return RolloutBatch(
        step=step,
        completions=completions,
        rewards=rewards,
        tokens=tokens,
        loss_mask=mask,
        behavior_logprobs=behavior,
        weight_versions=torch.tensor([min(c.versions, default=c.weight_version) for c in completions]),
        generate_seconds=seconds,
        routed_experts=pack_routing([c.routed_experts for c in completions], tokens.shape[1]),
        token_versions=versions.round().long(),
        reward_valid=scores.valid if excluded else None,
        reward_metrics=scores.metrics,
    )


@dataclass
class _FailedScoring:
    """A queued batch whose reward call failed (reward.on_failure=fail) while it was finished for a weight sync or a
    checkpoint: kept to be raised where the step takes it (:meth:`RolloutSource.get`, agreed across ranks there), never
    checkpointed (a resumed run makes it again)."""

    error: RewardFailed


class StalenessExceeded(RuntimeError):
    """A batch holds tokens sampled by weights older than ``train.staleness`` allows."""


class RolloutSource:
    def __init__(
        self,
        task,
        engine: RolloutEngine,
        sampling: SamplingConfig,
        prompts_per_step: int,
        group_size: int,
        staleness: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        partial: bool = False,
        scorer: Optional[RewardScorer] = None,
    ):
        self.task, self.engine, self.sampling = task, engine, sampling
        # the reward functions (reward.*); without one the task's own score()
        self.scorer = scorer if scorer is not None else RewardScorer([task_reward(task)])
        self.prompts_per_step, self.group_size, self.staleness = prompts_per_step, group_size, staleness
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.partial = partial and staleness > 0
        # futures resolve to _Generated (unscored; with partial rollouts possibly unfinished right after a pause)
        self.queue: dict[int, RolloutBatch | _Generated | Future] = {}
        # partial rollouts: a paused batch's resumption runs beside the next batch where the engine overlaps calls (a
        # served engine behind one rank); otherwise one thread, so every rank makes its calls in the same order
        overlaps = self.partial and engine.overlapping_generate
        workers = staleness + 1 if overlaps else 1
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout") if staleness else None

    def _generate(self, step: int) -> _Generated:
        per_rank = self.prompts_per_step // self.dp_size
        first = step * self.prompts_per_step + self.dp_rank * per_rank
        seed = (self.seed * 1_000_003 + step) * 1009 + self.dp_rank
        return _generate(
            self.task, self.engine, step, list(range(first, first + per_rank)), self.group_size, self.sampling, seed
        )

    def _finish(self, generated: _Generated) -> _Generated:
        """Resume an unfinished batch until every response is done (the calling thread; nothing pauses it)."""
        while not generated.finished:
            generated = _resume(self.engine, generated, self.sampling)
        return generated

    def _make(self, step: int) -> RolloutBatch:
        return _score(self.scorer, self.task, self._finish(self._generate(step)), self.group_size)

    def _resolve(self, item) -> RolloutBatch:
        """A queued item as a scored batch (scored in the calling thread if the background did not)."""
        if isinstance(item, RolloutBatch):
            return item
        generated = item.result() if isinstance(item, Future) else item
        if isinstance(generated, RolloutBatch):
            return generated
        return _score(self.scorer, self.task, self._finish(generated), self.group_size)

    def get(self, step: int) -> RolloutBatch:
        """The batch for ``step``; in async mode also submits the batch for ``step + staleness``."""
        if not self.staleness:
            return self._make(step)
        for ahead in range(step, step + self.staleness):
            if ahead not in self.queue:
                self.queue[ahead] = self._make(ahead)  # warm-up (or a queue lost with a checkpoint)
        # scored in the background too (the reward calls off the training step's path), unless partial rollouts may
        # pause it unfinished: then it is scored when used
        ahead = self._generate if self.partial else self._make
        self.queue[step + self.staleness] = self._pool.submit(ahead, step + self.staleness)
        item = self.queue.pop(step)
        if isinstance(item, _FailedScoring):
            raise item.error
        batch = self._resolve(item)
        lag = (step - batch.versions)[batch.loss_mask > 0]
        if self.partial and lag.numel() and int(lag.max()) > self.staleness:  # resumed responses: checked per token
            raise StalenessExceeded(
                f"step {step}: a response token was sampled by weights {int(lag.max())} updates "
                f"old, more than train.staleness={self.staleness}"
            )
        return batch

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """Around a weight sync. Without partial rollouts the generation in flight finishes first, with the weights
        it started with. With them it is paused at a token boundary, the sync runs, and every unfinished response
        continues with the new weights (submitted again in the background)."""
        if not self.partial:
            self.wait()
            yield
            return
        self.engine.pause()
        in_flight = [step for step, item in self.queue.items() if isinstance(item, Future)]
        try:
            for step in in_flight:  # promptly done: the engine returns what it has
                self.queue[step] = self.queue[step].result()
            yield
        except (EngineLost, Cancelled):
            # the sync failed on every rank (servers lost, a stop signal): that error is the one to report, never a
            # failure of the resume that follows it on a server that is gone (the resume is collective: all ranks
            # are here). Any other error ends the run without a resume.
            with contextlib.suppress(EngineLost, Cancelled, ServerUnavailable):
                self.engine.resume()
            raise
        self.engine.resume()
        for step in in_flight:  # every rank resumes the same batches, in order (collective engines)
            item = self.queue[step]
            if not item.finished or _collective(self.engine):
                self.queue[step] = self._pool.submit(_resume, self.engine, item, self.sampling)

    def wait(self) -> None:
        """Finish in-flight generation (before a weight sync or a checkpoint). A batch whose reward call fails is kept
        as failed and raised when its step takes it (every rank takes its batch at the same point)."""
        for step, item in list(self.queue.items()):
            if isinstance(item, _FailedScoring):
                continue
            try:
                self.queue[step] = self._resolve(item)
            except RewardFailed as err:
                self.queue[step] = _FailedScoring(err)

    def drop_unfinished(self) -> None:
        """Forget queued generations that did not finish (the engine was lost); a resumed run makes them again
        (the warm-up path of :meth:`get`). Completed batches stay for the checkpoint."""
        for step, item in list(self.queue.items()):
            if isinstance(item, _FailedScoring):
                del self.queue[step]
                continue
            if isinstance(item, Future):
                wait([item])
                if item.exception() is not None:
                    del self.queue[step]
                    continue
                item = item.result()
            if isinstance(item, _Generated) and not item.finished:
                del self.queue[step]

    def state_dict(self) -> dict:
        """Completed queued batches as plain data (tensors, numbers, strings, lists, dicts): checkpoints
        load with ``torch.load(weights_only=True)``."""
        self.wait()
        return {
            "queue": {
                int(step): dataclasses.asdict(batch)
                for step, batch in self.queue.items()
                if isinstance(batch, RolloutBatch)
            }
        }

    def load_state_dict(self, state: Optional[dict]) -> None:
        queue = state["queue"] if state else {}
        self.queue = {
            int(step): RolloutBatch(**{**fields, "completions": [Completion(**c) for c in fields["completions"]]})
            for step, fields in queue.items()
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.scorer.close()
