"""KL configurations: estimator x placement x level x credit x off-policy correction x aggregation.

Notation (docs/kl-math.md): d_t = log pi(y_t|s_t) - log pi_ref(y_t|s_t), D = sum_t d_t, KL_t the exact
per-position KL over the vocabulary, rho_t = pi/mu at the sampled token, rho_{1:t} = prod_{u<=t} rho_u.

Loss placement (:func:`kl_loss`, differentiable through ``logprobs`` and ``full_kl``):
  token level      coef * agg_t k(d_t)            E[grad] = sum_t grad KL_t with the prefix frozen (k2),
                                                   the token-level FORWARD KL (k3), zero (k1)
  token + token_is coef * agg_t w_t k(d_t), w_t = pi/mu differentiable: for k1 and k3 this is unbiased for
                                                   the token-level target under mu, sum_t E_mu[grad KL_t]
  sequence level   coef * agg_b k(D)              k2: (1/2) D^2 is unbiased for grad KL(seq)
  full, token      coef * agg_t KL_t              prefix-frozen token-level target, zero variance per position
  full, sequence   coef * agg_t [KL_t + log pi(y_t) * sg(sum_{s>t} KL_s)]      Rao-Blackwellised, unbiased
                   with per_decision: [rho_{1:t-1} KL_t + log pi(y_t) sg(sum_{s>t} rho_{1:s-1} KL_s)],
                   unbiased for the SEQUENCE grad KL under pi from samples of mu. (KL_s depends on the
                   state s_s only, so rho_{1:s-1} suffices; kl-math.md's rho_{1:s} is also unbiased but
                   noisier.)

Reward placement (:func:`kl_shaped_returns`): per-token returns R - coef * c_t with the detached credit
  reward_to_go   c_t = sum_{s>=t} p_s      (p = k(d) or KL; k1 here is unbiased for grad KL(seq))
  immediate      c_t = p_t
  sequence       c_t = k(D) for every token
  per_decision   c_t = sum_{s>=t} rho_{1:s} p_s   (rho_{1:s-1} for "full"), optionally truncated at
                 ``truncate``: E_mu[sum_t c_t grad log pi(y_t)] = grad KL(seq) under pi for k1.
The trainer turns returns into a gradient with :func:`policy_gradient_surrogate`: sum_t sg(c_t) x
grad log pi(y_t) for "none"/"per_decision", and the PPO-style ratio rho_t x grad log pi(y_t) for
"token_is". With per_decision, the KL part of the return already carries its weights: the trainer must
give the penalty part NO further ratio (compute the reward part's advantage with the correction it uses
and add -coef * c_t unweighted).

off_policy='behavior': the KL term borrows the behaviour correction of the policy loss (algo.behavior_correction,
megatron_kl.kl.corrections): its detached weights omega_t (from pi_old / mu) multiply each token's KL integrand
(loss placement: omega_t k(d_t), omega_t KL_t; a sequence-level term by the sequence's weight; reward placement:
omega_t sg(c_t) grad log pi(y_t)). Untruncated sequence IS (omega = prod_t pi/mu) turns every configuration that
is unbiased on-policy into one unbiased for the same target from mu's samples; truncation and masks are biased.
``megatron-kl audit`` measures each pairing; kl.target + kl.estimator=auto choose from those verdicts
(:mod:`megatron_kl.kl.audit.targets`).

Aggregation (a named, logged choice): seq_mean_token_sum = (1/B) sum_b sum_t; token_mean =
sum_{b,t} / #tokens; seq_mean_token_mean = (1/B) sum_b (1/L_b) sum_t. Masked positions never contribute.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_kl.kl.config import (  # noqa: F401
    AGGREGATIONS,
    AUTO,
    CREDITS,
    LEVELS,
    OFF_POLICY,
    PLACEMENTS,
    REGIMES,
    TARGETS,
    KLConfig,
)
from megatron_kl.kl.estimators import ClampCounter, clamp_log_ratio, token_estimate
from megatron_kl.kl.sequence_axis import LOCAL, SequenceAxis

# ------------------------------------------------------------------------------------------------
# helpers


def check_norm_length(aggregation: str, norm_length, where: str) -> None:
    if norm_length is not None and norm_length <= 0:
        raise ValueError(f"{where}.norm_length={norm_length} must be > 0")
    if aggregation == "seq_mean_token_sum_norm" and norm_length is None:
        raise ValueError(
            f"{where}.aggregation='seq_mean_token_sum_norm' divides by a fixed length: set "
            f"{where}.norm_length (the trainer uses rollout.sampling.max_new_tokens)"
        )


def aggregate_tokens(
    values: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    norm_length: Optional[float] = None,
    axis: SequenceAxis = LOCAL,
) -> torch.Tensor:
    """Reduce per-token values [B, T] (masked positions are zeroed here) to a scalar."""
    return aggregate_sequences(axis.seq_sum(values * mask.to(values.dtype)), mask, aggregation, norm_length, axis)


def aggregate_sequences(
    values: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    norm_length: Optional[float] = None,
    axis: SequenceAxis = LOCAL,
) -> torch.Tensor:
    """Reduce per-sequence values [B] (each the sum over that sequence's tokens) to a scalar (``mask``: [B, T],
    this rank's positions of the sequences, for the token counts)."""
    m = mask.to(values.dtype)
    batch = values.shape[0]
    if aggregation == "seq_mean_token_sum":
        return values.sum() / batch
    if aggregation == "token_mean":
        return values.sum() / axis.total(m).clamp_min(1.0)
    if aggregation == "seq_mean_token_mean":
        return (values / axis.seq_sum(m).clamp_min(1.0)).sum() / batch
    if aggregation == "seq_mean_token_sum_norm":
        check_norm_length(aggregation, norm_length, "aggregation")
        return values.sum() / (batch * norm_length)
    raise ValueError(f"aggregation={aggregation!r} is unknown; use one of {list(AGGREGATIONS)}")


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero masked positions without letting garbage there (inf/NaN) reach any gradient."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def _check(cfg: KLConfig, logprobs, ref_logprobs, mask, behavior_logprobs, full_kl, behavior_weight=None) -> None:
    if cfg.estimator == AUTO:
        raise ValueError(
            "KLConfig.estimator='auto' is resolved by the trainer (megatron_kl.kl.audit.targets.select) "
            "before any KL is computed"
        )
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must all be [batch, tokens]"
        )
    if cfg.off_policy in ("token_is", "per_decision") and behavior_logprobs is None:
        raise ValueError(f"KLConfig.off_policy={cfg.off_policy!r} needs behavior_logprobs (the sampler's log-probs)")
    if behavior_weight is not None and behavior_weight.shape != logprobs.shape:
        raise ValueError(f"behavior_weight shape {tuple(behavior_weight.shape)} != logprobs {tuple(logprobs.shape)}")
    if behavior_logprobs is not None and behavior_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"behavior_logprobs shape {tuple(behavior_logprobs.shape)} != logprobs {tuple(logprobs.shape)}"
        )
    if cfg.exact:
        if full_kl is None:
            raise ValueError("KLConfig.estimator='full' needs full_kl, the exact per-position KL [batch, tokens]")
        if full_kl.shape != logprobs.shape:
            raise ValueError(f"full_kl shape {tuple(full_kl.shape)} != logprobs {tuple(logprobs.shape)}")


def _correction(cfg: KLConfig, behavior_weight: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """The detached behaviour-correction weights omega_t [B, T] the KL term uses (off_policy='behavior'), else None."""
    if cfg.off_policy != "behavior":
        return None
    if behavior_weight is None:
        raise ValueError(
            "KLConfig.off_policy='behavior' needs behavior_weight, the behaviour correction's per-token "
            "weights (algo.behavior_correction must not be 'none')"
        )
    return _masked(behavior_weight.detach(), mask)


def _sequence_weight(weight: torch.Tensor, mask: torch.Tensor, axis: SequenceAxis = LOCAL) -> torch.Tensor:
    """One weight per sequence [B]: the mean of omega_t over its response tokens (the value itself for the
    sequence-wise corrections, whose omega_t is the same on every token)."""
    m = mask.to(weight.dtype)
    return axis.seq_sum(weight * m) / axis.seq_sum(m).clamp_min(1.0)


def _sequence_counter(counter: Optional[ClampCounter], axis: SequenceAxis) -> Optional[ClampCounter]:
    """The counter of per-sequence clamps: one rank of a context-parallel group counts each sequence once."""
    return counter if axis.counts_sequences else None


def _prefix_weights(
    cfg: KLConfig,
    logprobs,
    behavior_logprobs,
    mask,
    inclusive: bool,
    counter: Optional[ClampCounter],
    axis: SequenceAxis = LOCAL,
) -> torch.Tensor:
    """Detached rho_{1:t} (inclusive) or rho_{1:t-1} (exclusive), clamped in log space and truncated."""
    log_rho = _masked((logprobs - behavior_logprobs).detach(), mask)
    cumulative = axis.prefix(log_rho)
    if not inclusive:
        cumulative = cumulative - log_rho
    rho = torch.exp(clamp_log_ratio(cumulative, cfg.clamp, mask, counter, "prefix_weight"))
    if cfg.truncate is not None:
        rho = rho.clamp(max=cfg.truncate)
    return rho


# ------------------------------------------------------------------------------------------------
# public API


def kl_loss(
    cfg: KLConfig,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    behavior_logprobs: Optional[torch.Tensor] = None,
    full_kl: Optional[torch.Tensor] = None,
    counter: Optional[ClampCounter] = None,
    behavior_weight: Optional[torch.Tensor] = None,
    axis: SequenceAxis = LOCAL,
) -> torch.Tensor:
    """The KL term to ADD to the loss (already times ``coef``); zero for placement='reward'.

    ``behavior_weight`` (off_policy='behavior'): detached omega_t multiplying each token's term (a sequence-level
    estimate is weighted by its sequence's mean omega_t, i.e. the sequence correction's weight)."""
    _check(cfg, logprobs, ref_logprobs, mask, behavior_logprobs, full_kl, behavior_weight)
    if cfg.placement == "reward":
        return torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    weight = _correction(cfg, behavior_weight, mask)
    lp = _masked(logprobs, mask)
    d = lp - _masked(ref_logprobs.detach(), mask)
    if cfg.exact:
        kl_t = _masked(full_kl, mask)
        if cfg.level == "token":
            values = kl_t if weight is None else weight * kl_t
            return cfg.coef * aggregate_tokens(values, mask, cfg.aggregation, cfg.norm_length, axis)
        if cfg.off_policy == "per_decision":
            rho_prev = _prefix_weights(
                cfg, logprobs, behavior_logprobs, mask, inclusive=False, counter=counter, axis=axis
            )
            pathwise = rho_prev * kl_t
        else:
            pathwise = kl_t
        future = axis.suffix(pathwise.detach()) - pathwise.detach()  # sum_{s>t}
        values = pathwise + lp * future
        if weight is not None:
            values = _sequence_weight(weight, mask, axis)[:, None] * values
        return cfg.coef * aggregate_tokens(values, mask, cfg.aggregation, cfg.norm_length, axis)
    if cfg.level == "sequence":
        total = axis.seq_sum(d)
        values = token_estimate(
            cfg.estimator, total, cfg.clamp, axis.seq_sum(mask.to(d.dtype)) > 0, _sequence_counter(counter, axis)
        )
        if weight is not None:
            values = _sequence_weight(weight, mask, axis) * values
        return cfg.coef * aggregate_sequences(values, mask, cfg.aggregation, cfg.norm_length, axis)
    values = token_estimate(cfg.estimator, d, cfg.clamp, mask, counter)
    if cfg.off_policy == "token_is":
        log_w = clamp_log_ratio(lp - _masked(behavior_logprobs.detach(), mask), cfg.clamp, mask, counter, "token_is")
        values = torch.exp(log_w) * values
    elif weight is not None:
        values = weight * values
    return cfg.coef * aggregate_tokens(_masked(values, mask), mask, cfg.aggregation, cfg.norm_length, axis)


@torch.no_grad()
def kl_penalty_credit(
    cfg: KLConfig,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    behavior_logprobs: Optional[torch.Tensor] = None,
    full_kl: Optional[torch.Tensor] = None,
    counter: Optional[ClampCounter] = None,
    axis: SequenceAxis = LOCAL,
) -> torch.Tensor:
    """The detached credited penalty c_t [B, T] of a reward-placed KL (not times coef)."""
    _check(cfg, logprobs, ref_logprobs, mask, behavior_logprobs, full_kl)
    m = mask.to(logprobs.dtype)
    d = _masked(logprobs, mask) - _masked(ref_logprobs, mask)
    if cfg.exact:
        per_token = _masked(full_kl, mask).detach()
    else:
        per_token = _masked(token_estimate(cfg.estimator, d, cfg.clamp, mask, counter), mask)
    if cfg.level == "sequence":
        if cfg.exact:
            seq = axis.seq_sum(per_token)
        else:
            seq = token_estimate(
                cfg.estimator, axis.seq_sum(d), cfg.clamp, axis.seq_sum(m) > 0, _sequence_counter(counter, axis)
            )
        return seq[:, None] * m
    if cfg.off_policy == "per_decision":
        per_token = per_token * _prefix_weights(
            cfg, logprobs, behavior_logprobs, mask, inclusive=not cfg.exact, counter=counter, axis=axis
        )
    if cfg.effective_credit == "immediate":
        return per_token * m
    return axis.suffix(per_token * m) * m


def kl_shaped_returns(
    cfg: KLConfig,
    rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    behavior_logprobs: Optional[torch.Tensor] = None,
    full_kl: Optional[torch.Tensor] = None,
    counter: Optional[ClampCounter] = None,
    axis: SequenceAxis = LOCAL,
) -> torch.Tensor:
    """Per-token returns [B, T]: rewards[b] - coef * c_t for placement='reward', the broadcast rewards
    for placement='loss'; zero at masked positions. Detached."""
    if rewards.shape != logprobs.shape[:1]:
        raise ValueError(f"rewards must be [batch]={tuple(logprobs.shape[:1])}, got {tuple(rewards.shape)}")
    m = mask.to(logprobs.dtype)
    returns = rewards.detach().to(logprobs.dtype)[:, None] * m
    if cfg.placement == "loss":
        _check(cfg, logprobs, ref_logprobs, mask, behavior_logprobs, full_kl)
        return returns
    credit = kl_penalty_credit(cfg, logprobs, ref_logprobs, mask, behavior_logprobs, full_kl, counter, axis)
    return returns - cfg.coef * credit


def policy_gradient_surrogate(
    cfg: KLConfig,
    logprobs: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    behavior_logprobs: Optional[torch.Tensor] = None,
    counter: Optional[ClampCounter] = None,
    behavior_weight: Optional[torch.Tensor] = None,
    axis: SequenceAxis = LOCAL,
) -> torch.Tensor:
    """Scalar whose gradient is agg_t weight_t * values_t * grad log pi(y_t), values detached.

    weight_t = rho_t = pi/mu (PPO-style ratio) for off_policy='token_is'; the behaviour correction's omega_t
    (``behavior_weight``, detached) for off_policy='behavior'; 1 otherwise (per_decision weights are
    already inside the values built by :func:`kl_shaped_returns`). Maximise it for returns, or use it with
    the credited penalty to obtain the KL part of the gradient.
    """
    lp = _masked(logprobs, mask)
    values = _masked(values.detach(), mask)
    weight = _correction(cfg, behavior_weight, mask)
    if weight is not None:
        values = weight * values
    if cfg.off_policy == "token_is":
        if behavior_logprobs is None:
            raise ValueError("KLConfig.off_policy='token_is' needs behavior_logprobs")
        log_w = clamp_log_ratio(lp - _masked(behavior_logprobs.detach(), mask), cfg.clamp, mask, counter, "token_is")
        weighted = torch.exp(log_w) * values
    else:
        weighted = lp * values
    return aggregate_tokens(weighted, mask, cfg.aggregation, cfg.norm_length, axis)
