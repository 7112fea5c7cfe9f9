"""Behaviour (rollout) corrections: weights on the per-token policy loss for samples drawn from the rollout
engine's sampler mu instead of pi_old (a stale policy in async mode, another numeric stack in any mode).

With the per-token ratio w_t = pi_old(y_t|s_t) / mu(y_t|s_t) (from the trainer's recomputed log-probs and the
engine's behaviour log-probs) and the sequence ratio W = prod_t w_t (log-space sum over response tokens),
``algo.behavior_correction`` picks the weight c_t multiplying token t's policy loss:

  none            c_t = 1
  token_tis       c_t = min(w_t, tis_cap)                      truncated IS per token (``tis`` is its old name)
  sequence_tis    c_t = min(W, tis_cap)                        truncated IS per sequence
  token_mask      c_t = 1[mask_low <= w_t <= mask_high]        masked IS: drop tokens whose ratio is extreme
  sequence_mask   c_t = 1[mask_low <= W <= mask_high]          drop whole sequences
  geometric_mask  c_t = 1[mask_low <= W^(1/|y|) <= mask_high]  length-normalised (geometric mean) sequence mask
  icepop          c_t = w_t * 1[mask_low <= w_t <= mask_high]  IS weight, tokens outside the band masked

Truncation and masking trade the bias of E_mu[c * grad] against its variance; only untruncated IS (cap -> inf)
is unbiased for the on-policy gradient. How the weights meet the KL term is the KL config's business
(``kl.off_policy``), see ``docs/kl-math.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_kl.kl.config import CORRECTIONS, LOG_RATIO_CLAMP, PER_TOKEN_CORRECTIONS, canonical  # noqa: F401
from megatron_kl.kl.estimators import ClampCounter, clamp_log_ratio, token_estimate
from megatron_kl.kl.sequence_axis import LOCAL, SequenceAxis


@dataclass(frozen=True)
class Correction:
    """One behaviour correction with its thresholds (algo.behavior_correction, tis_cap, mask_low, mask_high)."""

    kind: str = "none"
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0

    @property
    def per_token(self) -> bool:
        """c_t depends on token t's own ratio w_t only (not on the rest of its sequence)."""
        return canonical(self.kind) in PER_TOKEN_CORRECTIONS

    @property
    def label(self) -> str:
        kind = canonical(self.kind)
        if kind.endswith("_tis"):
            return f"{kind}(cap {self.tis_cap:g})" if math.isfinite(self.tis_cap) else f"{kind}(uncapped)"
        if kind == "none":
            return kind
        return f"{kind}[{self.mask_low:g},{self.mask_high:g}]"

    def weights(self, old_logprobs, behavior_logprobs, mask, counter=None, axis: SequenceAxis = LOCAL):
        return behavior_weights(
            self.kind, old_logprobs, behavior_logprobs, mask, self.tis_cap, self.mask_low, self.mask_high, counter, axis
        )


def correction_of(algo) -> Correction:
    """The behaviour correction an ``algo.config.AlgoConfig`` configures (behavior_correction and its thresholds)."""
    return Correction(algo.behavior_correction, algo.tis_cap, algo.mask_low, algo.mask_high)


# the corrections the exact audit pairs with every KL configuration: each kind at the defaults, and the two
# truncated-IS kinds also uncapped (their unbiased limit)
AUDITED = tuple(Correction(kind) for kind in CORRECTIONS if kind not in ("none", "tis")) + (
    Correction("token_tis", math.inf),
    Correction("sequence_tis", math.inf),
)


def behavior_weights(
    kind: str,
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float,
    mask_low: float,
    mask_high: float,
    counter: Optional[ClampCounter] = None,
    axis: SequenceAxis = LOCAL,
) -> tuple[Optional[torch.Tensor], dict]:
    """(c [B, T] detached, or None for 'none'; metrics) for the correction ``kind`` (module docstring).

    Metrics: ``correction/truncated_fraction`` and ``correction/masked_fraction`` (of response tokens),
    ``correction/weight_mean``."""
    kind = canonical(kind)
    m = mask.bool()
    if kind == "none":
        return None, {}
    log_w = clamp_log_ratio(
        torch.where(m, old_logprobs - behavior_logprobs, torch.zeros_like(old_logprobs)),
        LOG_RATIO_CLAMP,
        mask,
        counter,
        "correction/clamped_ratio",
    ).detach()
    mf = m.to(log_w.dtype)
    tokens = axis.total(mf).clamp_min(1)
    log_seq = axis.seq_sum(log_w, keepdim=True).expand_as(log_w)  # log W, on every token of the sequence
    if kind in ("token_tis", "sequence_tis"):
        ratio = torch.exp(log_w if kind == "token_tis" else log_seq.clamp(max=LOG_RATIO_CLAMP))
        weight = ratio.clamp(max=tis_cap)
        kept = torch.ones_like(m)
        truncated = (ratio > tis_cap) & m
    else:
        if kind in ("token_mask", "icepop"):
            tested = log_w
        elif kind == "sequence_mask":
            tested = log_seq
        else:  # geometric_mask: the mean log-ratio over the sequence's response tokens
            tested = (log_seq[..., :1] / axis.seq_sum(mf, keepdim=True).clamp_min(1)).expand_as(log_w)
        value = torch.exp(tested.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        kept = (value >= mask_low) & (value <= mask_high)
        weight = kept.to(log_w.dtype) * (torch.exp(log_w) if kind == "icepop" else 1.0)
        truncated = torch.zeros_like(m)
    weight = torch.where(m, weight, torch.zeros_like(weight))
    metrics = {
        "correction/truncated_fraction": axis.total(truncated.to(mf.dtype)) / tokens,
        "correction/masked_fraction": axis.total((~kept & m).to(mf.dtype)) / tokens,
        "correction/weight_mean": axis.total(weight) / tokens,
    }
    return weight, metrics


def mismatch_metrics(
    old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor, axis: SequenceAxis = LOCAL
) -> dict:
    """KL(mu || pi_old) per response token, estimated on mu's samples: k1 = log mu - log pi_old and
    k3 = w - 1 - log w with w = pi_old / mu; and the ratio w's mean / min / max over response tokens."""
    m = mask.bool()
    log_w = torch.where(m, old_logprobs - behavior_logprobs, torch.zeros_like(old_logprobs)).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    w = torch.exp(log_w)
    mf = m.to(w.dtype)
    count = axis.total(mf)
    tokens = count.clamp_min(1)
    k3 = torch.where(m, token_estimate("k3", -log_w, None, m), torch.zeros_like(w))  # w - 1 - log w
    if float(count) == 0:  # no response token: the ratio's statistics are those of w = 1
        low = high = torch.ones(())
    else:
        low, high = axis.minimum(w[m]), axis.maximum(w[m])
    return {
        "mismatch/k1_token": float(axis.total(-log_w) / tokens),
        "mismatch/k3_token": float(axis.total(k3) / tokens),
        "is/ratio_mean": float(axis.total(w * mf) / tokens) if float(count) else 1.0,
        "is/ratio_min": float(low),
        "is/ratio_max": float(high),
    }
