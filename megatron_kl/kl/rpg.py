"""The RPG family of KL-regularised policy-gradient losses (Zhang et al., "On the Design of
KL-Regularized Policy Gradient Algorithms for LLM Reasoning").

Samples come from pi_old; per token, w = pi_theta / pi_old (importance weight), and with
u = pi_ref / pi_old (a constant) the four divergences are written as expectations under pi_old:

    RKL   KL(pi_theta || pi_ref)   = E_old[ w log(pi_theta/pi_ref) ]
    FKL   KL(pi_ref || pi_theta)   = E_old[ u log(pi_ref/pi_theta) ]
    URKL  unnormalised reverse KL  = E_old[ w log(pi_theta/pi_ref) - w + u ]      (on-policy: k3)
    UFKL  unnormalised forward KL  = E_old[ u log(pi_ref/pi_theta) - u + w ]

Their gradients all have the form E_old[ w * g_KL * grad log pi_theta ] with the per-token coefficient

    RKL: log(pi_theta/pi_ref) + 1     FKL: -u/w     URKL: log(pi_theta/pi_ref)     UFKL: 1 - u/w.

Two surrogates per divergence, both minimised, for advantages A:
  differentiable  L = agg[ -w A + beta * divergence_term ]          (autograd through w and log pi)
  reinforce       L = agg[ -sg(w * (A - beta * g_KL) * active) * log pi ]   (stop-gradient weights)
The REINFORCE-style form takes the RPG-style dual clip: a token is inactive (no gradient), as in
PPO's clipped objective, when A_eff > 0 and w > 1 + clip_high, when A_eff < 0 and w < 1 - clip_low, and
(dual clip) when A_eff < 0 and w > dual_clip, where A_eff = A - beta * g_KL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_kl.constraints import checked
from megatron_kl.kl.estimators import ClampCounter, clamp_log_ratio
from megatron_kl.kl.objective import AGGREGATIONS, aggregate_tokens
from megatron_kl.kl.sequence_axis import LOCAL, SequenceAxis

DIVERGENCES = ("rkl", "fkl", "urkl", "ufkl")
SURROGATES = ("differentiable", "reinforce")


@dataclass(frozen=True)
class RPGConfig:
    divergence: str = checked("urkl", choices=DIVERGENCES)
    surrogate: str = checked("reinforce", choices=SURROGATES)
    coef: float = checked(0.001, ge=0)  # beta
    clip_low: Optional[float] = checked(0.2, ge=0, lt=1)
    clip_high: Optional[float] = checked(0.28, ge=0)
    dual_clip: Optional[float] = checked(3.0, gt=1)
    clamp: Optional[float] = checked(20.0, gt=0)
    aggregation: str = checked("token_mean", choices=AGGREGATIONS)
    norm_length: Optional[float] = checked(None, gt=0)  # aggregation='seq_mean_token_sum_norm' (the trainer sets it)

    def __post_init__(self):
        for name, allowed in (("divergence", DIVERGENCES), ("surrogate", SURROGATES), ("aggregation", AGGREGATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RPGConfig.{name}={getattr(self, name)!r} is unknown; use one of {list(allowed)}")
        if self.norm_length is not None and self.norm_length <= 0:
            raise ValueError(f"RPGConfig.norm_length={self.norm_length} must be > 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"RPGConfig.dual_clip={self.dual_clip} must be > 1 (or None)")
        if self.surrogate == "differentiable" and any(
            v is not None for v in (self.clip_low, self.clip_high, self.dual_clip)
        ):
            raise ValueError("RPGConfig clip_low/clip_high/dual_clip apply to surrogate='reinforce'; set them to None")

    @property
    def name(self) -> str:
        return f"rpg-{self.divergence}-{self.surrogate}"


def rpg_loss(
    cfg: RPGConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    counter: Optional[ClampCounter] = None,
    axis: SequenceAxis = LOCAL,
) -> tuple[torch.Tensor, dict]:
    """The RPG loss (to minimise) and metrics {clip_fraction, kl_term}. All inputs [B, T]."""
    m = mask.bool()
    zero = torch.zeros_like(logprobs)
    lp = torch.where(m, logprobs, zero)
    old = torch.where(m, old_logprobs.detach(), zero)
    ref = torch.where(m, ref_logprobs.detach(), zero)
    adv = torch.where(m, advantages.detach().to(lp.dtype), zero)
    log_w = clamp_log_ratio(lp - old, cfg.clamp, mask, counter, "rpg/clamped_w")
    w = torch.exp(log_w)
    u = torch.exp(clamp_log_ratio(ref - old, cfg.clamp, mask, counter, "rpg/clamped_u"))
    log_ratio_ref = lp - ref  # log(pi_theta / pi_ref)
    if cfg.surrogate == "differentiable":
        term = {
            "rkl": w * log_ratio_ref,
            "fkl": -u * lp,  # + const; gradient -u grad log pi
            "urkl": w * log_ratio_ref - w + u,
            "ufkl": u * (ref - lp) - u + w,
        }[cfg.divergence]
        per_token = -w * adv + cfg.coef * term
        metrics = {"rpg/kl_term": aggregate_tokens(torch.where(m, term, zero).detach(), mask, cfg.aggregation, cfg.norm_length, axis)}
        return aggregate_tokens(torch.where(m, per_token, zero), mask, cfg.aggregation, cfg.norm_length, axis), metrics

    w_d = w.detach()
    g_kl = {
        "rkl": log_ratio_ref + 1.0,
        "fkl": -u / w_d,
        "urkl": log_ratio_ref,
        "ufkl": 1.0 - u / w_d,
    }[cfg.divergence].detach()
    effective = adv - cfg.coef * g_kl
    inactive = torch.zeros_like(m)
    if cfg.clip_high is not None:
        inactive |= (effective > 0) & (w_d > 1.0 + cfg.clip_high)
    if cfg.clip_low is not None:
        inactive |= (effective < 0) & (w_d < 1.0 - cfg.clip_low)
    if cfg.dual_clip is not None:
        inactive |= (effective < 0) & (w_d > cfg.dual_clip)
    inactive &= m
    weight = (w_d * effective * (~inactive)).detach()
    per_token = -weight * lp
    metrics = {
        "rpg/clip_fraction": axis.total(inactive.to(lp.dtype)) / axis.total(m.to(lp.dtype)).clamp_min(1),
        "rpg/kl_coefficient": aggregate_tokens(torch.where(m, g_kl, zero), mask, cfg.aggregation, cfg.norm_length, axis),
    }
    return aggregate_tokens(torch.where(m, per_token, zero), mask, cfg.aggregation, cfg.norm_length, axis), metrics
