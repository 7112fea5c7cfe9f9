"""The reverse KL to a teacher known only on its top-k tokens: the top-k approximation, in two named forms.

A served teacher (or one asked for its top-k log-probs to save memory) gives, per position, its k most likely
token ids S and their log-probs b_j = log p_T(j); the student's log-probs at the same ids are a_j = log pi(j).
The rest of the teacher's distribution is unknown, so KL(pi || p_T) = sum_a pi_a (log pi_a - log p_T(a)) cannot be
formed. Two approximations, named by ``distill.kl.top_k_tail``:

``bucket``      the KL between the two distributions coarse-grained to S and one "rest" outcome:
                    D = sum_{j in S} pi_j (a_j - b_j) + r_pi log(r_pi / r_T),   r = 1 - sum_{j in S} p_j.
                A divergence (>= 0, 0 iff pi and p_T agree on S and on the rest's total), a lower bound of the full
                KL (coarse-graining never raises a KL), and equal to it when pi's rest is p_T's rest scaled:
                    KL - D = r_pi KL(pi(. | rest) || p_T(. | rest)) >= 0.
``renormalize`` the KL between the two distributions restricted to S and renormalised:
                    D = sum_{j in S} q_j (log q_j - log q_T(j)),   q = pi_S / pi(S),  q_T = p_T,S / p_T(S);
                blind to the mass either puts outside S (a student may move mass off S at no cost).

Both equal the full KL when S holds the whole vocabulary. Per position D_t is a function of the student's
distribution at the prefix, so every placement and level of the exact term applies to it unchanged (the Rao-
Blackwellised sequence-level loss gives the unbiased gradient of E_pi[sum_t D_t], the surrogate's sequence-level
value): the approximation's bias is D's, not the estimator's (``megatron-kl audit --teacher`` measures it).

Numerics: near agreement (a ~ b) every difference is formed before a sum - sum_j pi_j (a_j - b_j) per id, the
rests' ratio as log1p((r_pi - r_T) / r_T) with r_pi - r_T = -sum_j p_T(j) expm1(a_j - b_j) - so the error scales
with D, not with log(k). A teacher rest below ``TAIL_FLOOR`` (its top-k holds all its mass to rounding) is clamped
there and counted (``topk_tail``).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_kl.kl.config import TOP_K_TAILS

TAIL_FLOOR = 1e-12  # smallest teacher rest mass the bucket form divides by


def _rest(log_probs: torch.Tensor) -> torch.Tensor:
    """1 - sum_j exp(log_probs_j) >= 0, accurate when the top-k holds nearly all the mass."""
    return (-torch.expm1(torch.logsumexp(log_probs, -1).clamp_max(0.0))).clamp_min(0.0)


def top_k_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    tail: str = "bucket",
    mask: Optional[torch.Tensor] = None,
    counter=None,
) -> torch.Tensor:
    """Per-position top-k divergence [...] (module docstring) from the student's log-probs ``student [..., k]`` at
    the teacher's top-k ids (differentiable) and the teacher's ``teacher [..., k]`` (constant). Computed in float64
    for float64 inputs, else float32; ``mask`` [...]: positions counted for the clamp (``counter.add``)."""
    if tail not in TOP_K_TAILS:
        raise ValueError(f"top_k_tail={tail!r} is unknown; use one of {list(TOP_K_TAILS)}")
    if student.shape != teacher.shape:
        raise ValueError(
            f"student log-probs {tuple(student.shape)} and teacher's {tuple(teacher.shape)} differ: "
            "both are at the teacher's top-k ids"
        )
    dtype = torch.float64 if student.dtype == torch.float64 else torch.float32
    a, b = student.to(dtype), teacher.detach().to(dtype)
    delta = a - b
    if tail == "renormalize":
        q_teacher = torch.softmax(b, -1)
        shift = torch.log1p((q_teacher * torch.expm1(delta)).sum(-1).clamp_min(torch.finfo(dtype).eps - 1.0))
        q_student = torch.softmax(a, -1)
        return (q_student * (delta - shift[..., None])).sum(-1).clamp_min(0.0)
    head = (a.exp() * delta).sum(-1)
    rest_student, rest_teacher = _rest(a), _rest(b)
    floored = rest_teacher < TAIL_FLOOR
    if counter is not None:
        hits = floored & (rest_student > 0) if mask is None else floored & (rest_student > 0) & mask.bool()
        counter.add("topk_tail", int(hits.sum()))
    rest_teacher = rest_teacher.clamp_min(TAIL_FLOOR)
    difference = -(b.exp() * torch.expm1(delta)).sum(-1)  # r_pi - r_T, formed per id
    ratio = (difference / rest_teacher).clamp_min(torch.finfo(dtype).eps - 1.0)
    ratio = torch.where(floored, rest_student / rest_teacher - 1.0, ratio)
    positive = rest_student > 0
    safe_rest = torch.where(positive, rest_student, torch.ones_like(rest_student))  # no 0 * -inf in any branch
    bucket = torch.where(
        positive, safe_rest * torch.log1p(ratio.clamp_min(torch.finfo(dtype).eps - 1.0)), torch.zeros_like(safe_rest)
    )
    return (head + bucket).clamp_min(0.0)
