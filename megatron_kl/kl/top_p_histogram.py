"""The top-p cut of rows over a tensor-parallel vocabulary from mass histograms (CPU, float32, C kernels).

The cut of a row is the last logit, in descending order, whose preceding mass is < top_p * total; every logit
>= it is kept. Found in a few passes over the local slice, each of them all-reduced:

1. the row's maximum and minimum (over all ranks);
2. one pass adds each logit's mass exp((x - max) / tau) to one of B buckets of logit value over
   [min, max]; all-reduced, the buckets give the normaliser (their sum) and the bucket j where the
   descending cumulative mass first reaches top_p * total: the cut lies in j (the mass above j is below the
   target, the mass through j is not), ties never straddle buckets;
3. one pass over bucket j's logits splits it into B finer buckets (mass, count, min, max) and copies up to
   ``cap`` of them per rank; if no rank holds more than ``cap``, the copies are gathered and the rule is
   applied to them exactly (float64 masses, offset by the mass above j); else the narrowing goes on in the
   fine bucket holding the cut, [min, max] of its logits (all equal: that value is the cut).

So a flat row of 32768 logits costs about three passes instead of one per bisection step. Rows left after
``MAX_LEVELS`` narrowings (a spread too small for float32 buckets) are returned as unresolved; the caller
finds them by bisection. Every rank takes the same steps (all decisions come from all-reduced values).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_kl.kl import native
from megatron_kl.kl.groups import group_size_rank

MAX_BUCKETS = 512
MIN_BUCKETS = 16
CAP = 512  # logits per row and rank copied by a narrowing pass
MAX_LEVELS = 6


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group_size_rank(group)[0] > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def supported(x: torch.Tensor) -> bool:
    """Whether the C kernels take ``x`` (float32 rows on the CPU, unit column stride) and are built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and (x.shape[1] <= 1 or x.stride(1) == 1)
            and native.library() is not None)


def buckets_for(vocab_size: int, world: int) -> int:
    """B for a shard of ``vocab_size / world`` columns: ~64 logits per bucket, 16..512 (the same on every rank)."""
    return int(min(MAX_BUCKETS, max(MIN_BUCKETS, vocab_size // (64 * world))))


def _row_extremes(x: torch.Tensor, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest logit and smallest finite one, over all ranks (float64)."""
    n, cols = x.shape
    high = torch.full((n,), float("-inf"), dtype=torch.float64)
    low = torch.full((n,), float("inf"), dtype=torch.float64)
    if cols:
        native.run_rows(native.library().extremes_f32, n, x.data_ptr(), x.stride(0), cols, high.data_ptr(),
                        low.data_ptr())
    return _all_reduce(high, dist.ReduceOp.MAX, group), _all_reduce(low, dist.ReduceOp.MIN, group)


def histogram_cut(x: torch.Tensor, top_p: float, temperature: float, group,
                  buckets: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``x [n, V_local]``: (cut, resolved, row_max, total) - the top-p cut where ``resolved``, the
    row maximum over all ranks and the float64 normaliser sum exp((x - max) / tau) over the whole vocabulary."""
    lib = native.library()
    n, cols = x.shape
    row_max, row_min = _row_extremes(x, group)
    cut = row_max.clone()
    spread = row_max - row_min
    scale = (buckets / spread).float()
    # one value per row (or none finite): the whole row is the support; a spread float32 cannot bucket: unresolved
    resolved = ~(spread > 0)
    pending = (spread > 0) & torch.isfinite(scale) & (scale > 0)
    row_max32, inv_tau = row_max.float(), 1.0 / temperature
    mass = torch.empty(n, buckets, dtype=torch.float64)
    native.run_rows(lib.histogram_f32, n, x.data_ptr(), x.stride(0), cols, row_max32.data_ptr(), scale.data_ptr(),
                    inv_tau, buckets, mass.data_ptr())
    _all_reduce(mass, dist.ReduceOp.SUM, group)
    total = mass.sum(-1)
    target = top_p * total
    bucket, above = _crossing(torch.zeros_like(total), mass, target)
    # first narrowing: bucket j's logits, (max - x) * s in [j, j + 1); its finer buckets span that interval
    low = torch.full((n,), float("-inf"), dtype=torch.float32)
    high = torch.full((n,), float("inf"), dtype=torch.float32)
    top = (row_max - bucket.double() / scale.double()).float()
    fine_scale = (scale.double() * buckets).float()
    fine_mass = torch.empty(n, buckets, dtype=torch.float64)
    fine_low, fine_high = torch.empty(n, buckets), torch.empty(n, buckets)
    members, held = torch.empty(n, CAP), torch.zeros(n, dtype=torch.int64)
    for _ in range(MAX_LEVELS):
        rows = pending.nonzero().squeeze(-1)
        if not rows.numel():
            break
        level1 = torch.full((n,), -1, dtype=torch.int32)  # rows < 0 are skipped
        level1[rows] = bucket[rows].to(torch.int32)
        native.run_rows(lib.refine_f32, n, x.data_ptr(), x.stride(0), cols, row_max32.data_ptr(), scale.data_ptr(),
                        level1.data_ptr(), low.data_ptr(), high.data_ptr(), top.data_ptr(), fine_scale.data_ptr(),
                        inv_tau, buckets, fine_mass.data_ptr(), fine_low.data_ptr(), fine_high.data_ptr(), CAP,
                        members.data_ptr(), held.data_ptr())
        most = _all_reduce(held[rows], dist.ReduceOp.MAX, group)  # the most any rank holds, per row
        done, rows = rows[most <= CAP], rows[most > CAP]
        if done.numel():  # every rank copied all its logits of the bucket: the exact cut among them
            width = max(1, int(most[most <= CAP].max()))
            gathered = _gather_columns(members[done, :width], group)
            cut[done] = _cut_among(gathered, row_max[done], total[done], above[done], top_p, temperature)
            resolved[done] = True
            pending[done] = False
        if not rows.numel():
            break
        # narrow to the fine bucket holding the cut: [min, max] of its logits
        row_mass = _all_reduce(fine_mass[rows], dist.ReduceOp.SUM, group)
        row_low = _all_reduce(fine_low[rows], dist.ReduceOp.MIN, group)
        row_high = _all_reduce(fine_high[rows], dist.ReduceOp.MAX, group)
        fine, above[rows] = _crossing(above[rows], row_mass, target[rows])
        low[rows] = row_low.gather(-1, fine[:, None]).squeeze(-1)
        high[rows] = row_high.gather(-1, fine[:, None]).squeeze(-1)
        tied = rows[low[rows] == high[rows]]  # one logit value (repeated) holds the cut
        cut[tied] = high[tied].double()
        resolved[tied] = True
        pending[tied] = False
        top = high
        fine_scale = (buckets / (high.double() - low.double())).float()
        pending &= torch.isfinite(fine_scale)
    return cut, resolved, row_max, total


def _crossing(above: torch.Tensor, mass: torch.Tensor, target: torch.Tensor):
    """The bucket [rows] where the descending cumulative mass (``above`` plus the buckets' masses, in order)
    first reaches ``target``, and the mass above that bucket."""
    cumulative = above[:, None] + mass.cumsum(-1)
    index = torch.searchsorted(cumulative, target[:, None]).squeeze(-1).clamp_max(mass.shape[-1] - 1)
    before = cumulative.gather(-1, index[:, None]).squeeze(-1) - mass.gather(-1, index[:, None]).squeeze(-1)
    return index, before


def _gather_columns(local: torch.Tensor, group) -> torch.Tensor:
    world = group_size_rank(group)[0]
    if world == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _cut_among(values: torch.Tensor, row_max, total, above, top_p: float, temperature: float) -> torch.Tensor:
    """The last logit the rule keeps among a bucket's logits ``values`` (-inf padded), whose preceding mass
    outside them is ``above``: float64 masses exp((v - max) / tau) / total in descending order."""
    ordered = values.sort(dim=-1, descending=True).values.double()  # (sorted in float32: the same order)
    finite = torch.isfinite(ordered)
    probs = torch.where(finite, torch.exp((ordered - row_max[:, None]) / temperature), 0.0) / total[:, None]
    before = above[:, None] / total[:, None] + probs.cumsum(-1) - probs
    kept = finite & (before < top_p)  # a prefix; its first logit is always kept (the mass above is < the target)
    last = kept.sum(-1).clamp_min(1) - 1
    return ordered.gather(-1, last[:, None]).squeeze(-1)
