"""The top-p cut of rows over a tensor-parallel vocabulary from mass histograms (CPU, float32, C kernels).

The cut of a row is the last logit, in descending order, whose preceding mass is < top_p * total; every logit
>= it is kept. Found in a few passes over the local slice, each of them all-reduced:

1. the row's maximum and smallest finite logit (over all ranks);
2. one pass adds each logit's mass exp((x - max) / tau) to one of B buckets of logit value over
   [min, max]; all-reduced, the buckets give the normaliser (their sum) and the bucket j where the
   descending cumulative mass first reaches top_p * total: the cut lies in j (the mass above j is below the
   target, the mass through j is not), ties never straddle buckets;
3. one pass over bucket j's logits splits it into FINE_BUCKETS finer buckets (mass, min, max) and copies up to
   ``CAP`` of them per rank; the fine bucket holding the cut is either one repeated value (the cut), or, where
   no rank holds more than ``CAP``, its copies are gathered and the rule is applied to them exactly (float64
   masses, offset by the mass above them); else the narrowing repeats within that fine bucket's [min, max].

With one rank (TP=1) the same steps run per row in one C call while the row is in cache. A flat row of 32768
logits costs about three passes instead of one per bisection step. Rows left after ``MAX_LEVELS`` narrowings
(a spread too small for float32 buckets) are returned as unresolved; the caller finds them by bisection. Every
rank takes the same steps (all decisions come from all-reduced values).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from megatron_kl.vocab_parallel import native
from megatron_kl.vocab_parallel.groups import all_gather_columns, all_reduce, group_size_rank

MAX_BUCKETS = 512
MIN_BUCKETS = 16
FINE_BUCKETS = 64  # of a narrowing pass
CAP = 512  # logits per row and rank copied by a narrowing pass
MAX_LEVELS = 6
C_LIMITS = (512, 64, 512)  # the C buffers' sizes for buckets, fine buckets and copies (top_p_search.c)


def supported(x: torch.Tensor) -> bool:
    """Whether the C kernels take ``x`` (float32 rows on the CPU, unit column stride) and are built."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and (x.shape[1] <= 1 or x.stride(1) == 1)
        and native.library() is not None
    )


def buckets_for(vocab_size: int, world: int) -> int:
    """B for a shard of ``vocab_size / world`` columns: ~64 logits per bucket, 16..512 (the same on every rank)."""
    return int(min(MAX_BUCKETS, max(MIN_BUCKETS, vocab_size // (64 * world))))


def _row_extremes(x: torch.Tensor, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest logit and smallest finite one, over all ranks (float64)."""
    n, cols = x.shape
    high = torch.full((n,), float("-inf"), dtype=torch.float64)
    low = torch.full((n,), float("inf"), dtype=torch.float64)
    if cols:
        native.run_rows(
            native.library().extremes_f32, n, x.data_ptr(), x.stride(0), cols, high.data_ptr(), low.data_ptr()
        )
    return all_reduce(high, dist.ReduceOp.MAX, group), all_reduce(low, dist.ReduceOp.MIN, group)


def histogram_cut(
    x: torch.Tensor, top_p: float, temperature: float, group, buckets: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``x [n, V_local]``: (cut, resolved, row_max, total) - the top-p cut where ``resolved``, the
    row maximum over all ranks and the float64 normaliser sum exp((x - max) / tau) over the whole vocabulary."""
    lib = native.library()
    n, cols = x.shape
    if any(size > limit for size, limit in zip((buckets, FINE_BUCKETS, CAP), C_LIMITS)):
        raise ValueError(f"buckets={buckets}, FINE_BUCKETS={FINE_BUCKETS}, CAP={CAP} exceed the C buffers {C_LIMITS}")
    if group_size_rank(group)[0] == 1:  # the whole vocabulary here: every step per row while it is in cache
        cut, row_max, total = (torch.empty(n, dtype=torch.float64) for _ in range(3))
        resolved = torch.empty(n, dtype=torch.uint8)
        native.run_rows(
            lib.top_p_rows_f32,
            n,
            x.data_ptr(),
            x.stride(0),
            cols,
            top_p,
            temperature,
            buckets,
            FINE_BUCKETS,
            CAP,
            MAX_LEVELS,
            cut.data_ptr(),
            row_max.data_ptr(),
            total.data_ptr(),
            resolved.data_ptr(),
        )
        return cut, resolved.bool(), row_max, total
    row_max, row_min = _row_extremes(x, group)
    cut = row_max.clone()
    spread = row_max - row_min
    scale = (buckets / spread).float()
    # one value per row (or none finite): the whole row is the support; a spread float32 cannot bucket: unresolved
    resolved = ~(spread > 0)
    pending = (spread > 0) & torch.isfinite(scale) & (scale > 0)
    row_max32, inv_tau = row_max.float(), 1.0 / temperature
    mass = torch.empty(n, buckets, dtype=torch.float64)
    native.run_rows(
        lib.histogram_f32,
        n,
        x.data_ptr(),
        x.stride(0),
        cols,
        row_max32.data_ptr(),
        scale.data_ptr(),
        inv_tau,
        buckets,
        mass.data_ptr(),
    )
    all_reduce(mass, dist.ReduceOp.SUM, group)
    total = mass.sum(-1)
    target = top_p * total
    bucket, above = _crossing(torch.zeros_like(total), mass, target)
    # first narrowing: bucket j's logits, (max - x) * s in [j, j + 1); its fine buckets span that interval
    low = torch.full((n,), float("-inf"), dtype=torch.float32)
    high = torch.full((n,), float("inf"), dtype=torch.float32)
    top = (row_max - bucket.double() / scale.double()).float()
    fine_scale = (scale.double() * FINE_BUCKETS).float()
    fine_mass = torch.empty(n, FINE_BUCKETS, dtype=torch.float64)
    fine_low, fine_high = torch.empty(n, FINE_BUCKETS), torch.empty(n, FINE_BUCKETS)
    members, held = torch.empty(n, CAP), torch.zeros(n, dtype=torch.int64)
    for _ in range(MAX_LEVELS):
        rows = pending.nonzero().squeeze(-1)
        if not rows.numel():
            break
        level1 = torch.full((n,), -1, dtype=torch.int32)  # rows < 0 are skipped
        level1[rows] = bucket[rows].to(torch.int32)
        native.run_rows(
            lib.refine_f32,
            n,
            x.data_ptr(),
            x.stride(0),
            cols,
            row_max32.data_ptr(),
            scale.data_ptr(),
            level1.data_ptr(),
            low.data_ptr(),
            high.data_ptr(),
            top.data_ptr(),
            fine_scale.data_ptr(),
            inv_tau,
            buckets,
            FINE_BUCKETS,
            fine_mass.data_ptr(),
            fine_low.data_ptr(),
            fine_high.data_ptr(),
            CAP,
            members.data_ptr(),
            held.data_ptr(),
        )
        # the fine bucket holding the cut: the mass above it, [min, max] of its logits
        fine, above_fine = _crossing(above[rows], all_reduce(fine_mass[rows], dist.ReduceOp.SUM, group), target[rows])
        fine_low_rows = all_reduce(fine_low[rows], dist.ReduceOp.MIN, group).gather(-1, fine[:, None]).squeeze(-1)
        fine_high_rows = all_reduce(fine_high[rows], dist.ReduceOp.MAX, group).gather(-1, fine[:, None]).squeeze(-1)
        most = all_reduce(held[rows].clone(), dist.ReduceOp.MAX, group)  # the most logits any rank holds
        tied = fine_low_rows == fine_high_rows  # one logit value (repeated): the cut
        copied = (most <= CAP) & ~tied  # every rank copied all its logits of the bucket: the cut among them
        cut[rows[tied]] = fine_high_rows[tied].double()
        if bool(copied.any()):
            done = rows[copied]
            cut[done] = _cut_in_bucket(
                members[done, : int(most[copied].max())],
                held[done],
                fine_low_rows[copied],
                fine_high_rows[copied],
                row_max[done],
                total[done],
                above_fine[copied],
                top_p,
                temperature,
                group,
            )
        finished = rows[tied | copied]
        resolved[finished] = True
        pending[finished] = False
        rest = ~(tied | copied)  # narrow to the fine bucket: [min, max] of its logits
        rows = rows[rest]
        above[rows], low[rows], high[rows] = above_fine[rest], fine_low_rows[rest], fine_high_rows[rest]
        top = high
        fine_scale = (FINE_BUCKETS / (high.double() - low.double())).float()
        pending &= torch.isfinite(fine_scale)
    return cut, resolved, row_max, total


def _crossing(above: torch.Tensor, mass: torch.Tensor, target: torch.Tensor):
    """The bucket [rows] where the descending cumulative mass (``above`` plus the buckets' masses, in order)
    first reaches ``target`` (a bucket holding logits: every logit's mass is > 0), and the mass above it."""
    cumulative = above[:, None] + mass.cumsum(-1)
    index = torch.searchsorted(cumulative, target[:, None]).squeeze(-1)
    # never past the last bucket holding logits (rounding could leave the target above the buckets' sum)
    occupied = torch.where(mass > 0, torch.arange(mass.shape[-1]), 0).amax(-1)
    index = torch.minimum(index, occupied)
    before = cumulative.gather(-1, index[:, None]).squeeze(-1) - mass.gather(-1, index[:, None]).squeeze(-1)
    return index, before


def _cut_in_bucket(members, held, low, high, row_max, total, above, top_p: float, temperature: float, group):
    """The rule's cut among the copied logits ``members [rows, w]`` (the first ``held`` valid on this rank) that
    lie in the fine bucket [low, high] holding it, gathered from every rank: descending float64 masses
    exp((v - max) / tau) / total after the mass ``above`` the bucket; the last one whose preceding mass is
    < top_p (the first always is: the mass above the bucket is below the target)."""
    valid = torch.arange(members.shape[-1])[None, :] < held[:, None]
    inside = valid & (members >= low[:, None]) & (members <= high[:, None])
    values = all_gather_columns(torch.where(inside, members, float("-inf")), group)
    count = all_reduce(inside.sum(-1), dist.ReduceOp.SUM, group)
    ordered = values.topk(max(1, int(count.max())), dim=-1).values.double()
    finite = torch.isfinite(ordered)
    probs = torch.where(finite, torch.exp((ordered - row_max[:, None]) / temperature), 0.0) / total[:, None]
    return last_kept(ordered, probs, finite, top_p, above[:, None] / total[:, None])


def last_kept(
    ordered: torch.Tensor, probs: torch.Tensor, candidate: torch.Tensor, top_p: float, mass_above: torch.Tensor = None
) -> torch.Tensor:
    """The top-p rule's cut among descending candidate values ``ordered [rows, n]``: the last position whose
    preceding mass - ``mass_above [rows, 1]`` (the mass above the first position; None: 0) plus the normalised
    ``probs`` of the positions before it - is below ``top_p``. Only ``candidate`` positions count (a prefix); the
    first position is always kept."""
    before = probs.cumsum(-1) - probs if mass_above is None else mass_above + probs.cumsum(-1) - probs
    kept = candidate & (before < top_p)  # a prefix
    last = kept.sum(-1).clamp_min(1) - 1
    return ordered.gather(-1, last[:, None]).squeeze(-1)
