"""In-domain and out-of-distribution evaluation: pass@1 (greedy) and mean@k (k samples at a temperature).

Each data-parallel rank evaluates a slice of the split; the sums are all-reduced over the DP group. Scores are
logged as ``eval/id/...`` (the task's in-domain split ``eval``) and ``eval/ood/...``. Responses are scored by the
run's reward functions (``reward.*``); with ``reward.on_failure=exclude`` a failed call scores 0 here and is counted
(``eval/<split>/reward_failed``), with ``fail`` it stops the run as in training.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_kl.models.parallel import all_reduce_cpu
from megatron_kl.rewards.scorer import RewardScorer, inputs_for, task_reward
from megatron_kl.rollout.engine import RolloutEngine, SamplingConfig


def evaluate(
    engine: RolloutEngine,
    task,
    split: str,
    sampling: SamplingConfig,
    k: int,
    temperature: float,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group=None,
    scorer: RewardScorer | None = None,
) -> dict:
    own = scorer is None
    scorer = RewardScorer([task_reward(task)]) if own else scorer
    total = task.num_problems(split)
    indices = list(range(total))[dp_rank::dp_size]
    problems = [task.problem(split, i) for i in indices]
    greedy = dataclasses.replace(sampling, temperature=0.0)
    sampled = dataclasses.replace(sampling, temperature=temperature)
    prompts = [p.prompt_ids for p in problems]
    first = engine.generate(prompts, greedy, seed=seed)
    many = engine.generate([p for p in prompts for _ in range(k)], sampled, seed=seed + 1)
    try:
        greedy_scores = scorer.score(inputs_for(problems, first, 1, task.tokenizer))
        sampled_scores = scorer.score(inputs_for(problems, many, k, task.tokenizer))
    finally:
        if own:
            scorer.close()
    failed = float(len(greedy_scores.failures) + len(sampled_scores.failures))
    sums = torch.tensor(
        [
            float(greedy_scores.rewards.double().sum()),
            float(sampled_scores.rewards.double().sum()) / k,
            float(len(problems)),
            failed,
        ],
        dtype=torch.float64,
    )
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        sums = all_reduce_cpu(sums, dp_group)
    n = max(float(sums[2]), 1.0)
    name = reported_name(split)
    out = {f"eval/{name}/pass@1": float(sums[0]) / n, f"eval/{name}/mean@{k}": float(sums[1]) / n}
    if float(sums[3]):
        out[f"eval/{name}/reward_failed"] = float(sums[3])
    return out


def reported_name(split: str) -> str:
    """The name a task split is logged under: the in-domain split ``eval`` (and ``eval:<file>``) as ``id``."""
    group, sep, part = split.partition(":")
    return ("id" if group == "eval" else group) + sep + part


def eval_groups(task) -> dict[str, list[str]]:
    """Reported split -> the splits it is made of (a task with several evaluation files, e.g. MATH-500, AIME
    and AMC, names one split per file; the group's score is their problem-weighted mean)."""
    groups = getattr(task, "eval_groups", None)
    return groups() if groups is not None else {"eval": ["eval"], "ood": ["ood"]}


def evaluate_all(
    engine: RolloutEngine,
    task,
    sampling: SamplingConfig,
    k: int,
    temperature: float,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group=None,
    scorer: RewardScorer | None = None,
) -> dict:
    """Every reported split that has problems, with per-file scores (``eval/<split>:<file>/...``) where a split
    has several."""
    out = {}
    for group, parts in eval_groups(task).items():
        if not sum(task.num_problems(part) for part in parts):
            continue  # e.g. no OOD files configured: no eval/ood/* at all rather than a score of 0.0
        if parts == [group]:
            out.update(
                evaluate(engine, task, group, sampling, k, temperature, seed, dp_rank, dp_size, dp_group, scorer)
            )
            continue
        sizes = {part: task.num_problems(part) for part in parts}
        for part in parts:
            out.update(evaluate(engine, task, part, sampling, k, temperature, seed, dp_rank, dp_size, dp_group, scorer))
        total = max(sum(sizes.values()), 1)
        for metric in ("pass@1", f"mean@{k}"):
            out[f"eval/{reported_name(group)}/{metric}"] = (
                sum(out[f"eval/{reported_name(part)}/{metric}"] * n for part, n in sizes.items()) / total
            )
    return out
