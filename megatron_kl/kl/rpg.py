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

from typing import Optional

import torch

from megatron_kl.kl.config import DIVERGENCES, SURROGATES, RPGConfig  # noqa: F401
from megatron_kl.kl.estimators import ClampCounter, clamp_log_ratio
from megatron_kl.kl.objective import aggregate_tokens
from megatron_kl.kl.sequence_axis import LOCAL, SequenceAxis


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
        metrics = {
            "rpg/kl_term": aggregate_tokens(
                torch.where(m, term, zero).detach(), mask, cfg.aggregation, cfg.norm_length, axis
            )
        }
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
        "rpg/kl_coefficient": aggregate_tokens(
            torch.where(m, g_kl, zero), mask, cfg.aggregation, cfg.norm_length, axis
        ),
    }
    return aggregate_tokens(torch.where(m, per_token, zero), mask, cfg.aggregation, cfg.norm_length, axis), metrics
