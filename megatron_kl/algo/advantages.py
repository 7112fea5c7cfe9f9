"""Sequence-level advantage estimators for outcome rewards, with samples grouped per prompt.

Rewards ``r [N]`` come in groups of ``G`` consecutive samples of the same prompt.

  grpo                  A = (r - mean_g r) / (std_g r + eps)    (std_normalize=false: Dr. GRPO, A = r - mean_g)
  rloo                  A = r - mean of the other G-1 samples = G/(G-1) (r - mean_g r)
  reinforce_pp          A = (r - mean_batch r) / (std_batch r + eps)      (REINFORCE++, global whitening)
  reinforce_pp_baseline A = whiten_batch(r - mean_g r)                     (REINFORCE++ with a group baseline)
  none                  A = r

The group baselines are leave-one-in (GRPO) or leave-one-out (RLOO); only RLOO's is independent of the
sample, so only RLOO is exactly unbiased for the policy gradient of E[r].

``valid [N]`` (samples whose reward call failed under ``reward.on_failure=exclude`` are False): every statistic above
is taken over the valid samples only - a group's mean and std over its valid members, RLOO's "other samples" are the
other valid ones (a group with fewer than two gives 0), the batch whitening over the valid samples - and an invalid
sample's advantage is 0. With every sample valid this is the formula above, computed by the same code.
"""

from __future__ import annotations

import torch

from megatron_kl.algo.config import ADVANTAGES
from megatron_kl.config import ConfigError


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x - x.mean()) / (x.std(unbiased=False) + eps) if x.numel() > 1 else x - x.mean()


def sequence_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: str,
    std_normalize: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    if estimator not in ADVANTAGES:
        raise ConfigError(f"algo.advantage={estimator!r} is unknown; use one of {list(ADVANTAGES)}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [N] with N divisible by group_size={group_size}")
    if valid is not None and not bool(valid.all()):
        if estimator == "rloo" and group_size < 2:
            raise ConfigError("algo.advantage='rloo' needs train.group_size >= 2")
        return _masked_advantages(rewards, group_size, estimator, std_normalize, eps, valid.bool())
    r = rewards.double()
    groups = r.view(-1, group_size)
    centered = (groups - groups.mean(-1, keepdim=True)).flatten()
    if estimator == "none":
        out = r
    elif estimator == "grpo":
        out = centered
        if std_normalize:
            std = groups.std(-1, unbiased=False, keepdim=True).expand_as(groups).flatten()
            out = centered / (std + eps)
    elif estimator == "rloo":
        if group_size < 2:
            raise ConfigError("algo.advantage='rloo' needs train.group_size >= 2")
        out = centered * group_size / (group_size - 1)
    elif estimator == "reinforce_pp":
        out = _whiten(r, eps)
    else:
        out = _whiten(centered, eps)
    return out.to(rewards.dtype)


def _masked_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str, std_normalize: bool, eps: float, valid: torch.Tensor
) -> torch.Tensor:
    """The estimators over the valid samples only; 0 for the others (module docstring)."""
    r = torch.where(valid, rewards.double(), torch.zeros((), dtype=torch.float64))
    keep = valid.double().view(-1, group_size)
    groups = r.view(-1, group_size)
    count = keep.sum(-1, keepdim=True)
    mean = groups.sum(-1, keepdim=True) / count.clamp(min=1)
    centered = ((groups - mean) * keep).flatten()
    if estimator == "none":
        out = r
    elif estimator == "grpo":
        out = centered
        if std_normalize:
            var = (((groups - mean) * keep) ** 2).sum(-1, keepdim=True) / count.clamp(min=1)
            out = centered / (var.sqrt().expand_as(groups).flatten() + eps)
    elif estimator == "rloo":
        scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
        out = (centered.view(-1, group_size) * scale).flatten()
    elif estimator == "reinforce_pp":
        out = _whiten_valid(r, valid, eps)
    else:
        out = _whiten_valid(centered, valid, eps)
    return torch.where(valid, out, torch.zeros_like(out)).to(rewards.dtype)


def _whiten_valid(x: torch.Tensor, valid: torch.Tensor, eps: float) -> torch.Tensor:
    kept = x[valid]
    if kept.numel() == 0:
        return torch.zeros_like(x)
    if kept.numel() == 1:
        return x - kept.mean()
    return (x - kept.mean()) / (kept.std(unbiased=False) + eps)
