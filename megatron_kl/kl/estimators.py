"""Per-token estimators of the reverse KL(pi_theta || pi_ref), log-ratio clamping, importance weights.

With d = log pi_theta(y|s) - log pi_ref(y|s) at the sampled token and r = exp(-d):

    k1 = d                      E_pi[k1] = KL,  grad_theta k1 = grad log pi        (E_pi[.] = 0)
    k2 = d^2 / 2                grad k2 = d grad log pi                            (score form of KL)
    k3 = r - 1 - log r          grad k3 = (1 - r) grad log pi; E_pi[grad k3] = grad of FORWARD KL
       = exp(-d) - 1 + d

Every exponential of a log-ratio goes through :func:`clamp_log_ratio`, which clamps to [-c, c] and counts
the clamped entries, so |d| up to 1e4 never produces inf/NaN, forward or backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_kl.kl.config import ESTIMATORS, LOG_RATIO_CLAMP, estimator_spec


def safe_exp_bound(dtype: torch.dtype) -> float:
    """Largest |x| such that exp(x) and its products stay finite in ``dtype`` (half the log of max)."""
    return 0.5 * math.log(torch.finfo(dtype).max)


@dataclass
class ClampCounter:
    """Counts log-ratio entries that were clamped; the trainer logs ``as_dict()`` each step. A name with a ``/``
    is a metric key itself (``policy/clamped_ratio``); any other name is a KL term's, ``kl/clamped_<name>``."""

    counts: dict = field(default_factory=dict)

    def add(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + int(n)

    def as_dict(self) -> dict:
        return {k if "/" in k else f"kl/clamped_{k}": v for k, v in self.counts.items()}


@dataclass
class TermCounter:
    """A :class:`ClampCounter` seen by one named KL term: its clamps are filed as ``<term>/clamped_<name>`` (the
    distillation term's as ``distill/clamped_k3``, apart from the reference term's ``kl/clamped_k3``)."""

    base: Optional[ClampCounter]
    term: str

    def add(self, name: str, n: int) -> None:
        if self.base is not None:
            self.base.add(name if "/" in name else f"{self.term}/clamped_{name}", n)


def clamp_log_ratio(
    log_ratio: torch.Tensor,
    clamp: Optional[float],
    mask: torch.Tensor,
    counter: Optional[ClampCounter] = None,
    name: str = "log_ratio",
) -> torch.Tensor:
    """Clamp to [-clamp, clamp] (and always to the dtype's safe exp range); count masked-in clamps."""
    bound = safe_exp_bound(log_ratio.dtype)
    if clamp is not None:
        bound = min(bound, float(clamp))
    clamped = log_ratio.clamp(-bound, bound)
    if counter is not None:
        counter.add(name, int(((log_ratio.abs() > bound) & mask.bool()).sum()))
    return clamped


def token_estimate(
    estimator: str,
    log_ratio: torch.Tensor,
    clamp: Optional[float],
    mask: torch.Tensor,
    counter: Optional[ClampCounter] = None,
) -> torch.Tensor:
    """k1 / k2 / k3 (or a registered per-token estimator: kl.config.ESTIMATORS) of a log-ratio tensor (per token, or
    per sequence when given D). The log-ratio is clamped for every estimator (a -inf reference log-prob gives a finite, counted value, never inf/NaN)."""
    spec = estimator_spec(estimator)
    if spec.full_distribution:
        raise ValueError(
            f"estimator={estimator!r} has no per-token form (it is the exact KL over the vocabulary); use "
            f"one of {[n for n, e in ESTIMATORS.items() if not e.full_distribution]}"
        )
    return spec.value(clamp_log_ratio(log_ratio, clamp, mask, counter, estimator))


def kl_metrics(logprobs, reference_logprobs, exact_kl, mask, prefix: str = "kl") -> dict:
    """k1, k3 and exact KL(pi_old || pi_ref) (when ``exact_kl`` is given), per response token and per sequence
    (sum over its tokens), as ``<prefix>/<estimator>_<token|sequence>`` (``distill``: the same to the teacher)."""
    d = (logprobs - reference_logprobs) * mask
    k3 = token_estimate("k3", d, LOG_RATIO_CLAMP, mask) * mask
    out = {}
    for name, per_token in (("k1", d), ("k3", k3), ("exact", None if exact_kl is None else exact_kl * mask)):
        if per_token is None:  # not computed this step (train.reference_metrics_interval)
            continue
        out[f"{prefix}/{name}_token"] = float((per_token * mask).sum() / mask.sum().clamp_min(1))
        out[f"{prefix}/{name}_sequence"] = float(per_token.sum(-1).mean())
    return out
