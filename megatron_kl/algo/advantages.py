"""Sequence-level advantage estimators for outcome rewards, with samples grouped per prompt.

Rewards ``r [N]`` come in groups of ``G`` consecutive samples of the same prompt.

  grpo                  A = (r - mean_g r) / (std_g r + eps)    (std_normalize=false: Dr. GRPO, A = r - mean_g)
  rloo                  A = r - mean of the other G-1 samples = G/(G-1) (r - mean_g r)
  reinforce_pp          A = (r - mean_batch r) / (std_batch r + eps)      (REINFORCE++, global whitening)
  reinforce_pp_baseline A = whiten_batch(r - mean_g r)                     (REINFORCE++ with a group baseline)
  none                  A = r

The group baselines are leave-one-in (GRPO) or leave-one-out (RLOO); only RLOO's is independent of the
sample, so only RLOO is exactly unbiased for the policy gradient of E[r].
"""

from __future__ import annotations

import torch

from megatron_kl.algo.config import ADVANTAGES
from megatron_kl.config import ConfigError


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x - x.mean()) / (x.std(unbiased=False) + eps) if x.numel() > 1 else x - x.mean()


def sequence_advantages(rewards: torch.Tensor, group_size: int, estimator: str,
                        std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    if estimator not in ADVANTAGES:
        raise ConfigError(f"algo.advantage={estimator!r} is unknown; use one of {list(ADVANTAGES)}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [N] with N divisible by group_size={group_size}")
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
