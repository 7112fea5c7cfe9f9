"""Rollout batches for training steps, on-policy or asynchronous with a staleness bound.

The batch of step t holds ``prompts_per_step / DP`` problems of this data-parallel rank (problem indices
``t * prompts_per_step + i``: the data cursor is the step), each sampled ``group_size`` times with a
seed derived from (seed, step, rank), so a batch is a pure function of the step and the engine weights.

Async (staleness s > 0): at the start of step t the batch for step t + s is submitted to a background
thread, generated from the engine's weights of version t while step t trains; before the next weight
sync the trainer waits for it. The batch used at step t therefore comes from weights of version
max(0, t - s): staleness t - version <= s, logged per sample. Completed queued batches are part of the
checkpoint, so a resumed run consumes exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_kl.rollout.engine import Completion, RolloutEngine, SamplingConfig
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

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class _Generated:
    """Completions of one step's prompts, not yet scored: what the background thread produces. Scoring
    runs in the main thread (``_score``): verifiers may rely on it (math-verify's timeouts use
    signal.alarm, which only works there)."""

    step: int
    problems: list
    prompts: list
    completions: list[Completion]
    generate_seconds: float


def _generate(task, engine: RolloutEngine, step: int, prompt_indices: list[int], group_size: int, sampling: SamplingConfig,
              seed: int) -> _Generated:
    problems = [task.problem("train", i) for i in prompt_indices]
    prompts = [p.prompt_ids for p in problems for _ in range(group_size)]
    start = time.perf_counter()
    completions = engine.generate(prompts, sampling, seed=seed)
    seconds = time.perf_counter() - start
    if len(completions) != len(prompts):
        raise RuntimeError(f"engine returned {len(completions)} completions for {len(prompts)} prompts")
    return _Generated(step, problems, prompts, completions, seconds)


def _score(task, generated: _Generated, group_size: int) -> RolloutBatch:
    """Rewards and the packed batch; call from the main thread."""
    completions, prompts, step, seconds = generated.completions, generated.prompts, generated.step, generated.generate_seconds
    scores = [task.score(generated.problems[i // group_size], c.response_ids) for i, c in enumerate(completions)]
    for i, score in enumerate(scores):
        if not isinstance(score, (int, float)) or not math.isfinite(float(score)):
            raise ValueError(f"task {type(task).__name__}: reward {score!r} of step {step}, sample {i} (prompt "
                             f"{i // group_size}, answer {generated.problems[i // group_size].answer!r}) is not a "
                             "finite number; a verifier must return a finite float")
    rewards = torch.tensor([float(x) for x in scores])
    tokens, mask, behavior = pack(prompts, [c.response_ids for c in completions], task.tokenizer.pad_id,
                                  per_token=[c.response_logprobs for c in completions])
    return RolloutBatch(step=step, completions=completions, rewards=rewards, tokens=tokens, loss_mask=mask,
                        behavior_logprobs=behavior,
                        weight_versions=torch.tensor([c.weight_version for c in completions]),
                        generate_seconds=seconds,
                        routed_experts=pack_routing([c.routed_experts for c in completions], tokens.shape[1]))


class RolloutSource:
    def __init__(self, task, engine: RolloutEngine, sampling: SamplingConfig, prompts_per_step: int, group_size: int,
                 staleness: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.task, self.engine, self.sampling = task, engine, sampling
        self.prompts_per_step, self.group_size, self.staleness = prompts_per_step, group_size, staleness
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.queue: dict[int, RolloutBatch | Future] = {}  # futures resolve to _Generated (unscored)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if staleness else None

    def _generate(self, step: int) -> _Generated:
        per_rank = self.prompts_per_step // self.dp_size
        first = step * self.prompts_per_step + self.dp_rank * per_rank
        seed = (self.seed * 1_000_003 + step) * 1009 + self.dp_rank
        return _generate(self.task, self.engine, step, list(range(first, first + per_rank)), self.group_size,
                         self.sampling, seed)

    def _make(self, step: int) -> RolloutBatch:
        return _score(self.task, self._generate(step), self.group_size)

    def _resolve(self, item) -> RolloutBatch:
        """A queued item as a scored batch, in the calling (main) thread."""
        return _score(self.task, item.result(), self.group_size) if isinstance(item, Future) else item

    def get(self, step: int) -> RolloutBatch:
        """The batch for ``step``; in async mode also submits the batch for ``step + staleness``."""
        if not self.staleness:
            return self._make(step)
        for ahead in range(step, step + self.staleness):
            if ahead not in self.queue:
                self.queue[ahead] = self._make(ahead)  # warm-up (or a queue lost with a checkpoint)
        self.queue[step + self.staleness] = self._pool.submit(self._generate, step + self.staleness)
        return self._resolve(self.queue.pop(step))

    def wait(self) -> None:
        """Finish in-flight generation (before a weight sync or a checkpoint)."""
        for step, item in list(self.queue.items()):
            self.queue[step] = self._resolve(item)

    def drop_unfinished(self) -> None:
        """Forget queued generations that did not finish (the engine was lost); a resumed run makes them again
        (the warm-up path of :meth:`get`). Completed batches stay for the checkpoint."""
        for step, item in list(self.queue.items()):
            if isinstance(item, Future):
                wait([item])
                if item.exception() is not None:
                    del self.queue[step]

    def state_dict(self) -> dict:
        """Completed queued batches as plain data (tensors, numbers, strings, lists, dicts): checkpoints
        load with ``torch.load(weights_only=True)``."""
        self.wait()
        return {"queue": {int(step): dataclasses.asdict(batch) for step, batch in self.queue.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        queue = state["queue"] if state else {}
        self.queue = {int(step): RolloutBatch(**{**fields, "completions": [Completion(**c) for c in fields["completions"]]})
                      for step, fields in queue.items()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
