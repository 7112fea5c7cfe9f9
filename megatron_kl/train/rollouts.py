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

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_kl.rollout.engine import Completion, SamplingConfig
from megatron_kl.train.batching import pack


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

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())


def build_rollout_batch(task, engine, step: int, prompt_indices: list[int], group_size: int,
                        sampling: SamplingConfig, seed: int) -> RolloutBatch:
    problems = [task.problem("train", i) for i in prompt_indices]
    prompts = [p.prompt_ids for p in problems for _ in range(group_size)]
    start = time.perf_counter()
    completions = engine.generate(prompts, sampling, seed=seed)
    seconds = time.perf_counter() - start
    if len(completions) != len(prompts):
        raise RuntimeError(f"engine returned {len(completions)} completions for {len(prompts)} prompts")
    rewards = torch.tensor([task.score(problems[i // group_size], c.response_ids) for i, c in enumerate(completions)])
    tokens, mask, behavior = pack(prompts, [c.response_ids for c in completions], task.tokenizer.pad_id,
                                  per_token=[c.response_logprobs for c in completions])
    return RolloutBatch(step=step, completions=completions, rewards=rewards, tokens=tokens, loss_mask=mask,
                        behavior_logprobs=behavior,
                        weight_versions=torch.tensor([c.weight_version for c in completions]),
                        generate_seconds=seconds)


class RolloutSource:
    def __init__(self, task, engine, sampling: SamplingConfig, prompts_per_step: int, group_size: int,
                 staleness: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.task, self.engine, self.sampling = task, engine, sampling
        self.prompts_per_step, self.group_size, self.staleness = prompts_per_step, group_size, staleness
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.queue: dict[int, RolloutBatch | Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if staleness else None

    def _make(self, step: int) -> RolloutBatch:
        per_rank = self.prompts_per_step // self.dp_size
        first = step * self.prompts_per_step + self.dp_rank * per_rank
        seed = (self.seed * 1_000_003 + step) * 1009 + self.dp_rank
        return build_rollout_batch(self.task, self.engine, step, list(range(first, first + per_rank)),
                                   self.group_size, self.sampling, seed)

    def get(self, step: int) -> RolloutBatch:
        """The batch for ``step``; in async mode also submits the batch for ``step + staleness``."""
        if not self.staleness:
            return self._make(step)
        for ahead in range(step, step + self.staleness):
            if ahead not in self.queue:
                self.queue[ahead] = self._make(ahead)  # warm-up (or a queue lost with a checkpoint)
        self.queue[step + self.staleness] = self._pool.submit(self._make, step + self.staleness)
        item = self.queue.pop(step)
        return item.result() if isinstance(item, Future) else item

    def wait(self) -> None:
        """Finish in-flight generation (before a weight sync or a checkpoint)."""
        for step, item in list(self.queue.items()):
            if isinstance(item, Future):
                self.queue[step] = item.result()

    def state_dict(self) -> dict:
        self.wait()
        return {"queue": dict(self.queue)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.queue = dict(state["queue"]) if state else {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
