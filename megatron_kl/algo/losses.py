"""The policy loss of one microbatch: PPO-clip (or RPG) + the configured KL term(s) + entropy bonus.

Per token, with rho = pi_theta / pi_old (pi_old: the policy at the start of the update), advantage A:

  ppo   max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)), and for A < 0 at most -A * dual_clip
        (dual clip, Ye et al. 2020); times the behaviour correction c_t of algo.behavior_correction
        (megatron_kl.kl.corrections: truncated / masked IS per token or sequence, ICEPOP; mu is the
        rollout engine's sampler, stale in async mode). algo.ratio_level=sequence (GSPO): rho is the
        sequence's length-normalised ratio exp(mean_t log(pi_theta/pi_old)), clipped per sequence and
        shared by its tokens.
  rpg   the RPG loss of megatron_kl.kl.rpg (its own KL term; kl.coef must then be 0).

KL, as configured by KLConfig (megatron_kl.kl.objective):
  placement=reward   -surrogate(c_t): sum_t sg(-coef c_t) * grad log pi(y_t), the credited penalty from
                     kl_shaped_returns, never clipped (PPO clipping would bias the KL gradient)
  placement=loss     kl_loss(...) with the live log-probs (and the exact KL for estimator='full')
  kl.off_policy=behavior: the behaviour correction's weights c_t also multiply the KL term (kl.objective)

Every term is reduced with its own aggregation over the MINIBATCH; ``Shares`` turns a microbatch's local
reduction into its exact share of the minibatch reduction, so gradient accumulation is exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_kl.algo.config import LOSSES, OLD_LOGPROBS, RATIO_LEVELS, AlgoConfig, row_separable  # noqa: F401
from megatron_kl.kl.config import LOG_RATIO_CLAMP, TOP_K
from megatron_kl.kl.corrections import correction_of
from megatron_kl.kl.estimators import ClampCounter, TermCounter, clamp_log_ratio
from megatron_kl.kl.objective import KLConfig, aggregate_tokens, kl_loss, kl_penalty_credit, policy_gradient_surrogate
from megatron_kl.kl.rpg import rpg_loss
from megatron_kl.kl.sequence_axis import LOCAL, SequenceAxis
from megatron_kl.kl.topk import top_k_divergence
from megatron_kl.models.batch import Microbatch, SequenceBatch
from megatron_kl.models.pipeline import masked_token_stats


@dataclass(frozen=True)
class LossInputs:
    """One (micro)batch's per-token inputs to the policy loss, each [b, T] and aligned with ``loss_mask`` (T = S - 1:
    position t scores token t + 1; with context parallelism, this rank's zigzag shard [b, 2L]).

    - ``loss_mask``: 1 on response tokens;
    - ``behavior_logprobs``: log mu(y_t), the sampler's (the rollout engine's, stale in async mode);
    - ``reference_logprobs``: log pi_ref(y_t) (zeros without a KL term: then unread);
    - ``advantages``: the reward part's sequence advantage (GRPO/RLOO/...) broadcast over the response;
    - ``old_logprobs``: log pi_old(y_t), the policy at the start of the update (None: the update's own forward
      is pi_old's, ``algo.old_logprobs=from_update``);
    - ``kl_returns``: the credited KL penalty -coef * c_t of the reward placement (None: formed from this forward,
      with ``old_logprobs``);
    - ``teacher_logprobs``: log pi_teacher(y_t) under distillation (None without), and ``distill_returns`` the
      distillation term's credited penalty of its reward placement (None: formed from this forward);
      ``teacher_top_logprobs [b, T, k]``: the teacher's log-probs at its top-k ids (``distill.kl.estimator=topk``).

    The trainer writes them into the batch's fields of the same names (:meth:`into`); the loss reads them back
    (:meth:`from_microbatch`), so a missing input is an error naming it.
    """

    loss_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    reference_logprobs: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: Optional[torch.Tensor] = None
    kl_returns: Optional[torch.Tensor] = None
    teacher_logprobs: Optional[torch.Tensor] = None
    distill_returns: Optional[torch.Tensor] = None
    teacher_top_logprobs: Optional[torch.Tensor] = None

    def into(self, batch: SequenceBatch) -> SequenceBatch:
        """``batch`` carrying these inputs (split with its rows): every field but the mask (the batch's own); those
        left None are not carried."""
        return dataclasses.replace(
            batch, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "loss_mask"}
        )

    @classmethod
    def from_microbatch(cls, mb: Microbatch) -> "LossInputs":
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [name for name in required if getattr(mb, name) is None]
        if missing:
            raise ValueError(
                f"the microbatch carries no {missing}: the policy loss needs {required} "
                "(LossInputs.into writes them into the batch)"
            )
        return cls(**{f.name: getattr(mb, f.name) for f in dataclasses.fields(cls)})


@dataclass
class Shares:
    """Minibatch denominators: a microbatch term reduced locally times ``factor`` is its exact share."""

    num_sequences: int
    num_tokens: float

    def factor(self, aggregation: str, mask: torch.Tensor, axis: SequenceAxis = LOCAL) -> float:
        if aggregation == "token_mean":
            return float(axis.total(mask.to(torch.float64)).clamp_min(1.0)) / max(self.num_tokens, 1.0)
        return mask.shape[0] / self.num_sequences


def ppo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    cfg: AlgoConfig,
    behavior_weight=None,
    counter: Optional[ClampCounter] = None,
    axis: SequenceAxis = LOCAL,
):
    """Per-token PPO-clip loss [B, T] (masked positions 0) and the clipped-token indicator."""
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    if cfg.ratio_level == "sequence":  # GSPO: exp(mean_t log ratio), the same on every token of the sequence
        log_ratio = (
            axis.seq_sum(log_ratio, keepdim=True) / axis.seq_sum(m.to(log_ratio.dtype), keepdim=True).clamp_min(1)
        ).expand_as(log_ratio)
    log_ratio = clamp_log_ratio(log_ratio, LOG_RATIO_CLAMP, mask, counter, "policy/clamped_ratio")
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if cfg.dual_clip is not None:
        cap = -adv * cfg.dual_clip
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    if behavior_weight is not None:
        loss = loss * behavior_weight.detach()
    zero = torch.zeros_like(loss)
    return torch.where(m, loss, zero), was_clipped & m, torch.where(m, ratio.detach(), zero)


@dataclass
class MicrobatchLoss:
    """``loss_fn`` of a training minibatch: ``(stats, mb) -> (loss, metrics)``; ``probe`` is the same loss
    without side effects (no clamp counting), for the fused single pass when ``row_separable``."""

    algo: AlgoConfig
    kl: KLConfig
    shares: Shares
    counter: Optional[ClampCounter] = None
    # algo.old_logprobs=from_update: each microbatch's detached, masked stats (its pi_old; pipeline.
    # MicrobatchStats of ``captured_keys``: pipeline.masked_token_stats), for pipeline.assemble_token_stats
    captured: Optional[list] = None
    captured_keys: tuple = ("logprobs", "entropy")
    axis: SequenceAxis = LOCAL  # the token axis: whole, or this rank's zigzag shard of a context-parallel group
    distill: Optional[KLConfig] = None  # the distillation term (on-policy distillation), None without

    @property
    def row_separable(self) -> bool:
        return row_separable(self.kl, self.algo) and (self.distill is None or row_separable(self.distill, self.algo))

    def __call__(self, stats, mb: Microbatch):
        if self.captured is not None:
            with torch.no_grad():
                self.captured.append(masked_token_stats(stats, mb, self.captured_keys))
        return microbatch_loss(stats, mb, self.algo, self.kl, self.shares, self.counter, self.axis, self.distill)

    def probe(self, stats, mb: Microbatch) -> torch.Tensor:
        return microbatch_loss(stats, mb, self.algo, self.kl, self.shares, None, self.axis, self.distill)[0]


MICROBATCH_TOKENS = "_tokens"  # a microbatch's response tokens, the weight of its per-token metrics


def microbatch_loss(
    stats,
    mb: Microbatch,
    algo: AlgoConfig,
    kl: KLConfig,
    shares: Shares,
    counter: Optional[ClampCounter] = None,
    axis: SequenceAxis = LOCAL,
    distill: Optional[KLConfig] = None,
) -> tuple[torch.Tensor, dict]:
    """This microbatch's share of the minibatch loss, and metrics (sums to be averaged by the caller).

    ``mb`` carries the :class:`LossInputs` in its fields of the same names (with its tokens and rows).
    With a context-parallel ``axis`` they are this rank's zigzag shard [b, 2L] and every reduction over the
    sequence crosses the group (``kl.sequence_axis``): the loss and metrics are the whole sequences' on every
    rank, and back-propagating ``loss * axis.share`` on each gives each rank its shard of the gradient.

    ``distill``: the distillation term's KLConfig (on-policy distillation; None without): the same estimator
    machinery as ``kl`` with log pi_teacher in log pi_ref's place. ``stats.kl``, the exact per-position KL of this
    forward, is to the teacher when ``distill`` is given and to the reference otherwise; with ``distill``,
    ``stats.regularizer_kl`` is the exact KL to the reference beside it.
    """
    inputs = LossInputs.from_microbatch(mb)
    mask = inputs.loss_mask.to(stats.logprobs.dtype)
    logprobs = stats.logprobs
    metrics: dict = {}
    exact_to_reference = stats.regularizer_kl if distill is not None else stats.kl  # beside the teacher's, or alone
    exact_to_teacher = stats.kl if distill is not None else None
    if distill is not None and distill.estimator == TOP_K:  # the top-k divergence in the exact KL's place
        if stats.candidate_logprobs is None or inputs.teacher_top_logprobs is None:
            raise ValueError(
                "distill.kl.estimator=topk: the microbatch carries no teacher_top_ids / "
                "teacher_top_logprobs (the step writes the teacher's top-k into the batch)"
            )
        exact_to_teacher = top_k_divergence(
            stats.candidate_logprobs,
            inputs.teacher_top_logprobs,
            distill.top_k_tail,
            inputs.loss_mask,
            TermCounter(counter, "distill") if counter is not None else None,
        )
        distill = distill.per_position()
    if inputs.old_logprobs is None:  # algo.old_logprobs=from_update: this forward is pi_old's
        inputs = dataclasses.replace(inputs, old_logprobs=logprobs.detach())
        if kl.coef > 0 and kl.placement == "reward":
            inputs = dataclasses.replace(
                inputs,
                kl_returns=_credited(kl, inputs, inputs.reference_logprobs, mask, exact_to_reference, counter, axis),
            )
        if distill is not None and distill.coef > 0 and distill.placement == "reward":
            inputs = dataclasses.replace(
                inputs,
                distill_returns=_credited(
                    distill,
                    inputs,
                    inputs.teacher_logprobs,
                    mask,
                    exact_to_teacher,
                    TermCounter(counter, "distill"),
                    axis,
                ),
            )
    weight = None
    if algo.loss == "ppo":
        weight, correction = correction_of(algo).weights(
            inputs.old_logprobs, inputs.behavior_logprobs, mask, counter, axis
        )
        metrics.update(correction)
        per_token, clipped, ratio = ppo_loss(
            logprobs, inputs.old_logprobs, inputs.advantages, mask, algo, weight, counter, axis
        )
        policy = aggregate_tokens(per_token, mask, algo.aggregation, algo.norm_length, axis)
        metrics["policy/clip_fraction"] = axis.total(clipped.to(mask.dtype)) / axis.total(mask).clamp_min(1)
        metrics["policy/ratio_max"] = axis.maximum(ratio)
    else:
        policy, rpg_metrics = rpg_loss(
            algo.rpg, logprobs, inputs.old_logprobs, inputs.reference_logprobs, inputs.advantages, mask, counter, axis
        )
        metrics.update(rpg_metrics)
        metrics["policy/clip_fraction"] = rpg_metrics.get("rpg/clip_fraction", torch.zeros(()))
    policy_share = shares.factor(algo.aggregation, mask, axis)
    total = policy * policy_share
    terms = [("kl_term", kl, inputs.reference_logprobs, inputs.kl_returns, exact_to_reference, counter)]
    if distill is not None:
        if inputs.teacher_logprobs is None:
            raise ValueError(
                "the microbatch carries no teacher_logprobs: the distillation term needs the teacher's "
                "log-probs (LossInputs.into writes them into the batch)"
            )
        terms.append(
            (
                "distill_term",
                distill,
                inputs.teacher_logprobs,
                inputs.distill_returns,
                exact_to_teacher,
                TermCounter(counter, "distill") if counter is not None else None,
            )
        )
    for name, term, other_logprobs, returns, exact, clamps in terms:
        if term.coef == 0:
            continue
        if term.placement == "reward":
            value = -policy_gradient_surrogate(
                term, logprobs, returns, mask, inputs.behavior_logprobs, clamps, behavior_weight=weight, axis=axis
            )
        else:
            value = kl_loss(
                term,
                logprobs,
                other_logprobs,
                mask,
                inputs.behavior_logprobs,
                full_kl=exact,
                counter=clamps,
                behavior_weight=weight,
                axis=axis,
            )
        share = value * shares.factor(term.aggregation, mask, axis)
        total = total + share
        metrics[f"loss/{name}"] = share.detach()
    if algo.entropy_coef:
        entropy = aggregate_tokens(stats.entropy, mask, algo.aggregation, algo.norm_length, axis)
        total = total - algo.entropy_coef * entropy * shares.factor(algo.aggregation, mask, axis)
    # loss/* are this microbatch's shares of the minibatch value (they add up over its microbatches); the rest
    # are means over its response tokens, averaged by the caller with weight MICROBATCH_TOKENS
    metrics["loss/policy"] = (policy * policy_share).detach()
    metrics["loss/total"] = total.detach()
    metrics[MICROBATCH_TOKENS] = axis.total(mask)
    return total, metrics


def _credited(term: KLConfig, inputs: LossInputs, other_logprobs, mask, exact, counter, axis) -> torch.Tensor:
    """-coef * c_t of a reward-placed KL term, from pi_old's log-probs of this forward."""
    return -term.coef * kl_penalty_credit(
        term,
        inputs.old_logprobs,
        other_logprobs,
        mask.bool(),
        inputs.behavior_logprobs,
        full_kl=None if exact is None else exact.detach(),
        counter=counter,
        axis=axis,
    )
