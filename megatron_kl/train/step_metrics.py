"""What one RL step reports beside its loss: the KL between policy and reference (k1, k3 and the exact KL, masked
means over response tokens), the rollout's agreement with the trainer (behaviour vs. recomputed log-probs, importance
ratios, stale versions), the top-k / top-p support check and routing replay's agreement."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_kl.kl.config import LOG_RATIO_CLAMP
from megatron_kl.kl.corrections import mismatch_metrics
from megatron_kl.kl.estimators import token_estimate
from megatron_kl.models import pipeline
from megatron_kl.models.parallel import all_reduce_cpu
from megatron_kl.rollout.http import CorruptResponse
from megatron_kl.train.rollouts import RolloutBatch


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp_min(1))


def kl_metrics(logprobs, reference_logprobs, exact_kl, mask, prefix: str = "kl") -> dict:
    """k1, k3 and exact KL(pi_old || pi_ref) (when ``exact_kl`` is given), per response token and per sequence
    (sum over its tokens), as ``<prefix>/<estimator>_<token|sequence>`` (``distill``: the same to the teacher)."""
    d = (logprobs - reference_logprobs) * mask
    k3 = token_estimate("k3", d, LOG_RATIO_CLAMP, mask) * mask
    out = {}
    for name, per_token in (("k1", d), ("k3", k3), ("exact", None if exact_kl is None else exact_kl * mask)):
        if per_token is None:  # not computed this step (train.reference_metrics_interval)
            continue
        out[f"{prefix}/{name}_token"] = _masked_mean(per_token, mask)
        out[f"{prefix}/{name}_sequence"] = float(per_token.sum(-1).mean())
    return out


def rollout_metrics(batch: RolloutBatch, old_logprobs: torch.Tensor, step: int) -> dict:
    mask = batch.loss_mask
    mismatch = ((old_logprobs - batch.behavior_logprobs) * mask).abs()
    staleness = (step - batch.weight_versions).float()  # per sample: its oldest token's
    token_lag = (step - batch.versions).float() * mask
    versions = [set(c.versions) for c in batch.completions]
    # rewards of the samples that were scored (failed ones, reward.on_failure=exclude, are not zeros to average)
    scored = batch.rewards if batch.reward_valid is None else batch.rewards[batch.reward_valid]
    if not scored.numel():
        scored = torch.zeros(1)
    return {
        **batch.reward_metrics,
        **mismatch_metrics(old_logprobs, batch.behavior_logprobs, mask),
        "reward/mean": float(scored.mean()),
        "reward/std": float(scored.std(unbiased=False)),
        "reward/accuracy": float((scored >= 1.0).float().mean()),
        "response/length_mean": float(mask.sum(-1).mean()),
        # tokens the training passes see: real (prompt + response) and as padded to the longest sequence
        "batch/tokens": float(sum(len(c.prompt_ids) + len(c.response_ids) for c in batch.completions)),
        "batch/padded_tokens": float(batch.tokens.numel()),
        "response/stopped_fraction": sum(c.finish_reason == "stop" for c in batch.completions) / len(batch.completions),
        "mismatch/abs_logprob_mean": _masked_mean(mismatch, mask),
        "mismatch/abs_logprob_max": float(mismatch.max()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        # per response token: the weights that sampled it (partial rollouts: a response can span several versions)
        "staleness/token_mean": _masked_mean(token_lag, mask),
        "staleness/token_max": float(token_lag.max()) if mask.numel() else 0.0,
        "staleness/older_token_fraction": _masked_mean((token_lag > 0).float(), mask),
        "staleness/mixed_response_fraction": sum(len(v) > 1 for v in versions) / max(len(versions), 1),
    }


class OutsideSupport(CorruptResponse):
    """Sampled tokens outside the trainer's truncated support at the weights that sampled them."""


def support_metrics(batch: RolloutBatch, old: pipeline.TokenStats, step: int, sampling, dp_group) -> dict:
    """The truncated policy's support over the response tokens (empty without truncation): the mass it leaves
    out of the full softmax, its size, and the sampled tokens outside it. A token the engine sampled must lie
    in the trainer's support at the weights that sampled it (rows of this step's weight version); more than
    ``rollout.sampling.support_tolerance`` of them outside (over every data-parallel rank) is an error naming
    the first one, raised on every rank together."""
    if not old.truncated:
        return {}
    mask = batch.loss_mask
    outside = old.outside_support * mask
    fresh = (batch.versions == step) & (mask > 0)  # tokens sampled by this step's weights
    stray = (outside > 0) & fresh
    counts = torch.tensor([float(stray.sum()), float(fresh.sum())], dtype=torch.float64)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        counts = all_reduce_cpu(counts, dp_group)
    strays, fresh_tokens = int(counts[0]), int(counts[1])
    if fresh_tokens and strays > sampling.support_tolerance * fresh_tokens:
        where = "on another data-parallel rank"
        if bool(stray.any()):
            row, position = (int(i) for i in stray.nonzero()[0])
            where = f"completion {row}, response position {position + 1 - len(batch.completions[row].prompt_ids)}"
        raise OutsideSupport(
            f"{strays} of {fresh_tokens} sampled tokens lie outside the trainer's top-k/top-p support at the weights "
            f"that sampled them (first: {where}): the engine does not sample the distribution the trainer trains "
            f"(rollout.sampling.top_k={sampling.top_k}, top_p={sampling.top_p}, temperature={sampling.temperature}) "
            "or its logits differ beyond rounding; rollout.sampling.support_tolerance sets the fraction allowed"
        )
    return {
        "sampling/truncated_mass": _masked_mean(1.0 - old.kept_mass, mask),
        "sampling/support_size": _masked_mean(old.support_size, mask),
        "sampling/outside_support": _masked_mean(outside, mask),
    }


def replay_metrics(own: Optional[torch.Tensor], batch: RolloutBatch) -> dict:
    """With routing replay, on metric steps: the train-vs-rollout mismatch pi_old would have had with the trainer's
    own routing (``own``: the pass without replay), next to the replayed one (mismatch/abs_logprob_mean)."""
    if own is None:
        return {}
    mask = batch.loss_mask
    return {"moe/mismatch_without_replay": _masked_mean((own - batch.behavior_logprobs).abs() * mask, mask)}
