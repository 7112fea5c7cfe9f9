"""Top-k / top-p supports over a tensor-parallel vocabulary, exact across shards, without gathering logits.

The sampling distribution of an engine with truncation is mu = trunc(softmax(x / tau)): keep the support,
renormalise. The rule (``filter_logits`` of the embedded engine; vLLM and SGLang agree up to how they break
exact ties) is:

    top-k:  keep every token whose logit is >= the k-th largest logit                (ties at the k-th kept)
    top-p:  on the top-k distribution, sort by logit (descending), keep position i while the mass of the
            positions before it is < top_p; then keep every token whose logit is >= the last kept one

so the support is always ``{a : x_a >= threshold}`` for one threshold per row. This module finds that
threshold with the vocabulary sharded over ``tp_group``:

1. each rank's ``m`` largest logits (``m = top_k``, one more under top-p, or a first guess for top-p alone;
   found from block maxima) are all-gathered and merged:
   every value above ``floor`` (the largest of the ranks' m-th values) is then known with its multiplicity;
2. the k-th largest is the top-k threshold (the merged list holds the global top k);
3. the normaliser of the top-k distribution is one all-reduced sum over the local slice;
4. the top-p cut is found on the merged list (float64 cumulative mass); a row whose cut is not above
   ``floor`` (a support larger than the candidates) gets it by bisection on the logit value - one all-reduced
   pass per step - until at most BRACKET_CANDIDATES logits lie in the bracket, which are then gathered, so the
   answer is exact (under top-k, where ties at the k-th value can leave the fast path: 8x more candidates).

Top-p alone on float32 CPU logits takes another route: ``top_p_histogram`` (mass histograms of logit value in
C kernels, about three passes per row whatever the support's size; the bisection remains its fallback and the
route without a C compiler). On a GPU the bisection does not pass over the logits at each step: each rank sorts
its rows once and keeps float64 suffix masses, so the mass and count above a value are a binary search
(``BISECTION_LOOKUP``; the pass per step was 56-64x the full statistics on an H100 where the nucleus holds most
of the vocabulary).

The kernels (``vocab_parallel``, ``fused_linear``) take the threshold and compute log-probs, entropy and
the exact KL(mu || pi_ref) of the truncated distribution (docs/kl-math.md states which distributions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_kl.vocab_parallel import top_p_histogram
from megatron_kl.vocab_parallel.config import Truncation  # noqa: F401
from megatron_kl.vocab_parallel.groups import all_gather_columns, all_reduce, group_size_rank

FIRST_CANDIDATES = 64  # per rank, top-p only: a first guess at the support size (bisection where short)
CANDIDATE_ELEMENTS = 1 << 22  # entries held at once by a retry (candidates rows x world x m, copied logits)
SUM_BLOCK = 256  # columns summed in float32 before the float64 total (a float64 sum costs ~9x on CPU)
RETRY_FACTOR = 8  # under top-k, rows whose k-th value ties beyond the candidates: 8x more per round
BRACKET_CANDIDATES = 256  # logits (over all ranks) left in the bisection bracket before the exact cut is taken
MAX_BISECTIONS = 64
# how the bisection finds the mass and count of the logits above a value: "pass" (a pass over the rows per step:
# no extra memory, the CPU's way), "sorted" (rows sorted once, float64 suffix masses, a binary search per step:
# a sorted copy and two float64 arrays of a row block of CANDIDATE_ELEMENTS, the GPU's way), "auto" (sorted on
# CUDA tensors)
BISECTION_LOOKUP = "auto"


def effective(truncation: Optional[Truncation], vocab_size: Optional[int]) -> Optional[Truncation]:
    """``truncation`` where it truncates a vocabulary of ``vocab_size``, else None (the full distribution)."""
    return truncation if truncation is not None and truncation.active(vocab_size) else None


def _local_top(x: torch.Tensor, m: int) -> torch.Tensor:
    """This rank's m largest values per row, descending; -inf where the shard has fewer columns.

    Exact, from block maxima: the m blocks (of ``width`` columns) with the largest maxima hold m values >= the
    m-th largest block maximum L, so the m-th largest value is >= L and every value above L lies in those
    blocks; the top m of the m blocks (plus the columns after the last whole block) are the row's top m as a
    multiset. A max pass and two small ``topk`` instead of a ``topk`` over the shard (~3x cheaper on CPU);
    ``width`` ~ sqrt(cols / m) balances the two."""
    n, cols = x.shape
    top = torch.full((n, m), float("-inf"), dtype=x.dtype, device=x.device)
    k = min(m, cols)
    if not k or not n:
        return top
    width = 1 << max(3, round(math.log2(math.sqrt(4 * cols / k))))
    blocks = cols // width
    if blocks < 4 * k or x.device.type != "cpu" or x.stride(-1) != 1:  # few blocks (or a GPU's topk): directly
        top[:, :k] = torch.topk(x, k, dim=-1, sorted=True).values
        return top
    whole = blocks * width
    tiled = x[:, :whole].unflatten(-1, (blocks, width))  # a view, also of a column slice
    chosen = torch.topk(tiled.amax(-1), k, dim=-1, sorted=False).indices  # [n, k]
    if x.stride(0) % width == 0:  # blocks are rows of one [*, width] view of the storage: a row copy each
        per_row = x.stride(0) // width
        rows = torch.as_strided(x, ((n - 1) * per_row + blocks, width), (width, 1))  # up to the last block
        chosen += torch.arange(n, device=x.device)[:, None] * per_row
        pool = rows.index_select(0, chosen.view(-1)).view(n, -1)
    else:
        pool = tiled.gather(1, chosen[:, :, None].expand(n, k, width)).reshape(n, -1)  # [n, k * width]
    if whole < cols:
        pool = torch.cat([pool, x[:, whole:]], dim=-1)
    return _local_top(pool, m)  # the pool by the same rule (a direct topk once it is small)


def _candidates(x: torch.Tensor, m: int, group):
    """Merged candidates [n, world*m] (descending) and the floor [n] above which they are complete."""
    local = _local_top(x, m)
    merged = all_gather_columns(local, group)
    world = merged.shape[-1] // m
    floor = merged.view(merged.shape[0], world, m)[:, :, m - 1].amax(-1)  # every value > floor is present
    return merged.sort(dim=-1, descending=True).values, floor


def _row_blocks(n: int, cols: int):
    block = max(1, (1 << 20) // max(1, cols))
    return [slice(a, min(n, a + block)) for a in range(0, n, block)]


@dataclass(frozen=True)
class Support:
    """``threshold [n]``: the support is ``{a : x_a >= threshold}`` (-inf where nothing is truncated);
    ``row_max [n]``: each row's largest logit over all ranks, found on the way (None where nothing is
    truncated), so that a kernel need not look for it again."""

    threshold: torch.Tensor
    row_max: Optional[torch.Tensor] = None


def support_threshold(
    logits: torch.Tensor, tp_group, truncation: Truncation, temperature: float = 1.0, vocab_size: Optional[int] = None
) -> torch.Tensor:
    """``find_support(...).threshold``."""
    return find_support(logits, tp_group, truncation, temperature, vocab_size).threshold


def find_support(
    logits: torch.Tensor, tp_group, truncation: Truncation, temperature: float = 1.0, vocab_size: Optional[int] = None
) -> Support:
    """Per row of the local logits slice ``[n, V_local]`` (valid columns only, no padding), the threshold t
    with support ``{a : x_a >= t}`` of the truncated distribution over the whole sharded vocabulary; -inf
    where nothing is truncated. Same value on every rank. No gradient (the support is piecewise constant).
    ``vocab_size``: the true vocabulary (top_k >= vocab_size is no truncation)."""
    x = logits.detach()
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    n, cols = x.shape
    threshold = torch.full((n,), float("-inf"), dtype=dtype, device=x.device)
    vocab = vocab_size
    if vocab is None:  # the whole sharded vocabulary (a collective only when the caller does not know it)
        total_cols = torch.tensor([cols], device=x.device)
        vocab = int(all_reduce(total_cols, dist.ReduceOp.SUM, tp_group).item())
    if n == 0 or not truncation.active(vocab):
        return Support(threshold)
    x = x.to(dtype)
    top_k = truncation.top_k if 0 < truncation.top_k < vocab else 0
    first = None
    # under top-p too, one candidate more per rank than top-k needs: the fast path below then knows that no
    # logit tied with the k-th was left on a rank (its floor lies below the k-th value)
    m_first = top_k + 1 if top_k and truncation.top_p < 1.0 else top_k
    if top_k:
        first = _candidates(x, m_first, tp_group)
        threshold = first[0][:, top_k - 1].clone()
    if truncation.top_p >= 1.0:
        return Support(threshold, first[0][:, 0])
    if top_k and bool((first[1] < threshold).all()):
        # every logit >= the k-th is among the candidates (no tie at the k-th left on a rank): the top-k
        # distribution's normaliser comes from them, no pass over the shard
        merged = first[0]
        row_max = merged[:, 0]
        probs = _masses(merged, row_max, temperature)
        total = torch.where(merged >= threshold[:, None], probs, torch.zeros_like(probs)).sum(-1)
        cut = _top_p_cut(
            x, row_max, total, threshold, truncation.top_p, temperature, tp_group, m_first, cols, first=first
        )
        return Support(torch.maximum(threshold, cut), row_max)
    if first is None and top_p_histogram.supported(x):  # top-p alone, float32 on the CPU: mass histograms
        world = group_size_rank(tp_group)[0]
        cut, resolved, row_max, total = top_p_histogram.histogram_cut(
            x, truncation.top_p, temperature, tp_group, top_p_histogram.buckets_for(vocab, world)
        )
        row_max = row_max.to(dtype)
        if not bool(resolved.all()):  # too narrow a spread for float32 buckets: bisection (no candidates)
            rows = (~resolved).nonzero().squeeze(-1)
            peak = row_max[rows]
            cut[rows] = _bracket_cut(
                x[rows], peak, total[rows], peak[:, None], peak, truncation.top_p, temperature, tp_group
            ).double()
        return Support(cut.to(dtype), row_max)
    if first is None:  # top-p alone: the first candidates (their largest is the row's maximum over all ranks)
        m_first = FIRST_CANDIDATES
        first = _candidates(x, m_first, tp_group)
    row_max = first[0][:, 0]
    # the (top-k) distribution's normaliser (float64), over the local slice in cache-sized blocks
    total = torch.zeros(n, dtype=torch.float64, device=x.device)
    for rows in _row_blocks(n, cols):
        e = _exp_shifted(x[rows], row_max[rows], temperature)
        if top_k:  # float mask arithmetic (a bool masked_fill costs ~3x a float pass on CPU)
            e.addcmul_(e, torch.lt(x[rows], threshold[rows, None]).to(e.dtype), value=-1.0)
        total[rows] = _sum64(e)
    all_reduce(total, dist.ReduceOp.SUM, tp_group)
    cut = _top_p_cut(x, row_max, total, threshold, truncation.top_p, temperature, tp_group, m_first, cols, first=first)
    return Support(torch.maximum(threshold, cut), row_max)


def _exp_shifted(x: torch.Tensor, row_max: torch.Tensor, temperature: float) -> torch.Tensor:
    """exp((x - max) / tau) per row, in a new tensor of x's dtype (one pass fewer at tau = 1)."""
    e = torch.sub(x, row_max[:, None])
    return (e.div_(temperature) if temperature != 1.0 else e).exp_()


def _masses(values: torch.Tensor, row_max: torch.Tensor, temperature: float) -> torch.Tensor:
    """exp((v - max) / tau) in float64 for gathered candidate values (the cumulative masses of the top-p rule)."""
    return torch.exp((values.double() - row_max[:, None].double()) / temperature)


def _sum64(e: torch.Tensor) -> torch.Tensor:
    """Row sums in float64 from float32 partial sums of SUM_BLOCK columns (relative error ~1e-8, not 1e-7)."""
    full = e.shape[-1] // SUM_BLOCK * SUM_BLOCK
    total = e[:, full:].sum(-1, dtype=torch.float64)
    if full:  # (a shard of padding only has no columns)
        total += e[:, :full].reshape(e.shape[0], full // SUM_BLOCK, SUM_BLOCK).sum(-1).sum(-1, dtype=torch.float64)
    return total


def _top_p_cut(
    x, row_max, total, top_k_threshold, top_p: float, temperature: float, group, m: int, cols: int, first=None
):
    """The top-p threshold per row: from the merged candidates of the first round (``first``, already gathered
    with ``m`` per rank, or gathered here), exact where the cut lies above their floor; the other rows by
    bisection (top-p alone, :func:`_bracket_cut`) or with 8x more candidates per round (under top-k)."""
    n = x.shape[0]
    cut = torch.full((n,), float("-inf"), dtype=x.dtype, device=x.device)
    # every rank takes the same steps: sizes agree because the pending rows are computed from gathered data
    max_cols = torch.tensor([cols], device=x.device)
    all_reduce(max_cols, dist.ReduceOp.MAX, group)
    max_cols = int(max_cols.item())
    m = max(1, min(m, max_cols))
    merged, floor = first if first is not None else _candidates(x, m, group)
    value = _cut_on_candidates(merged, row_max, total, top_k_threshold, top_p, temperature)
    resolved = (value > floor) | (m >= max_cols)  # exact above the floor (every value >= it is a candidate)
    cut[resolved] = value[resolved]
    pending = (~resolved).nonzero().squeeze(-1)
    world = group_size_rank(group)[0]
    if not bool(torch.isfinite(top_k_threshold).any()):  # top-p alone: bisection, in row blocks
        block = max(1, CANDIDATE_ELEMENTS // max(1, cols))
        for lo in range(0, pending.numel(), block):
            rows = pending[lo : lo + block]
            cut[rows] = _bracket_cut(
                x[rows], row_max[rows], total[rows], merged[rows], floor[rows], top_p, temperature, group
            )
        return cut
    while pending.numel():  # under top-k (ties at the k-th left out of the candidates): more candidates
        m = min(max_cols, m * RETRY_FACTOR)
        complete = m >= max_cols
        unresolved = []
        # row blocks bound the merged candidates [rows, world * m] and the copy of the rows' logits
        block = max(1, CANDIDATE_ELEMENTS // max(world * m, cols))
        for lo in range(0, pending.numel(), block):
            rows = pending[lo : lo + block]
            merged, floor = _candidates(x[rows], m, group)
            value = _cut_on_candidates(merged, row_max[rows], total[rows], top_k_threshold[rows], top_p, temperature)
            resolved = (value > floor) | complete
            cut[rows[resolved]] = value[resolved]
            unresolved.append(rows[~resolved])
        pending = torch.cat(unresolved)
    return cut


def _bracket_cut(x, row_max, total, merged, floor, top_p: float, temperature: float, group):
    """The top-p cut of rows whose first candidates fell short (top-p alone), by bisection on the logit value:
    keep a bracket (lo, hi] with mass{x > lo} >= top_p > mass{x > hi} (so the cut lies in it; lo starts below
    every logit, hi at the floor of the first candidates ``merged``, both with known masses and counts) until it
    holds at most BRACKET_CANDIDATES logits over all ranks, then take the cut among those, gathered, with
    float64 masses offset by mass{x > hi}. One pass over the rows per bisection (``e`` cached); every rank takes
    the same steps (the masses and counts are all-reduced)."""
    b, cols = x.shape
    flag, product = torch.empty_like(x), torch.empty_like(x)  # reused: a fresh large buffer per pass page-faults
    if _sorted_lookup(x):
        above = _SortedRows(x, row_max, temperature).above
    else:
        e = _exp_shifted(x, row_max, temperature)

        def above(t):  # [mass, count] of this rank's logits > t, [2, b] float64
            torch.lt(t[:, None], x, out=flag)  # 1.0 / 0.0 (float: a bool pass costs ~3x on CPU)
            return torch.stack([_sum64(torch.mul(flag, e, out=product)), _sum64(flag)])  # counts exact below 2^24

    lo = x.amin(-1) if cols else torch.full((b,), float("inf"), dtype=x.dtype, device=x.device)
    all_reduce(lo, dist.ReduceOp.MIN, group)
    lo = lo - 1.0  # every logit lies above lo: its mass is the total, its count the vocabulary's
    count = torch.full((b,), float(cols), dtype=torch.float64, device=x.device)
    lo_stats = torch.stack([total.clone(), all_reduce(count, dist.ReduceOp.SUM, group)])
    hi = floor.to(x.dtype)  # the candidates above the floor are all the logits above it
    above_floor = merged > floor[:, None]
    probs = _masses(merged, row_max, temperature)
    hi_stats = torch.stack(
        [torch.where(above_floor, probs, torch.zeros_like(probs)).sum(-1), above_floor.sum(-1).double()]
    )
    target = top_p * total
    for _ in range(MAX_BISECTIONS):
        mid = (lo + hi) / 2
        # rows still wide, and with a float strictly between lo and hi (else the bracket is all ties)
        wide = ((lo_stats[1] - hi_stats[1]) > BRACKET_CANDIDATES) & (mid > lo) & (mid < hi)
        if not bool(wide.any()):
            break
        stats = all_reduce(above(torch.where(wide, mid, hi)), dist.ReduceOp.SUM, group)
        lower = wide & (stats[0] >= target)  # mass above mid still reaches top_p: the cut lies above mid
        upper = wide & ~lower
        lo, lo_stats = torch.where(lower, mid, lo), torch.where(lower[None], stats, lo_stats)
        hi, hi_stats = torch.where(upper, mid, hi), torch.where(upper[None], stats, hi_stats)
    width = int((lo_stats[1] - hi_stats[1]).max().item())
    # the bracket's logits, the others -inf: x where lo < x <= hi, via float masks (NaN-free: -inf * 0 is avoided)
    torch.lt(lo[:, None], x, out=flag).mul_(torch.le(x, hi[:, None], out=product))
    values = torch.where(flag > 0, x, float("-inf"))
    bracket = all_gather_columns(_local_top(values, max(1, width)), group).sort(dim=-1, descending=True).values
    probs = _masses(bracket, row_max, temperature) / total[:, None]
    probs = torch.where(torch.isfinite(bracket), probs, torch.zeros_like(probs))
    return top_p_histogram.last_kept(
        bracket, probs, torch.isfinite(bracket), top_p, hi_stats[0][:, None] / total[:, None]
    )


def _sorted_lookup(x: torch.Tensor) -> bool:
    if BISECTION_LOOKUP not in ("auto", "sorted", "pass"):
        raise ValueError(f"truncation.BISECTION_LOOKUP={BISECTION_LOOKUP!r}: use auto, sorted or pass")
    return BISECTION_LOOKUP == "sorted" or (BISECTION_LOOKUP == "auto" and x.is_cuda)


class _SortedRows:
    """A row block's logits sorted ascending once, with suffix sums of exp((v - max) / tau) in float64 (from the
    largest down, so a small mass above a high value is not the difference of two large ones): the mass and count
    of the logits > t are one binary search a row."""

    def __init__(self, x: torch.Tensor, row_max: torch.Tensor, temperature: float):
        self.values = x.sort(dim=-1).values
        masses = _masses(self.values, row_max, temperature)  # exp(-inf) = 0 for masked logits
        suffix = masses.flip(-1).cumsum(-1).flip(-1)
        self.suffix = torch.cat([suffix, suffix.new_zeros(suffix.shape[0], 1)], -1)  # [b, cols + 1]

    def above(self, t: torch.Tensor) -> torch.Tensor:
        """[mass, count] of this rank's logits > t, [2, b] float64."""
        first = torch.searchsorted(self.values, t[:, None].to(self.values.dtype).contiguous(), right=True)
        mass = self.suffix.gather(-1, first).squeeze(-1)
        return torch.stack([mass, (self.values.shape[-1] - first.squeeze(-1)).double()])


def _cut_on_candidates(merged, row_max, total, top_k_threshold, top_p: float, temperature: float):
    """The last value the top-p rule keeps among merged candidates (descending, float64 masses)."""
    kept = merged >= top_k_threshold[:, None]
    probs = _masses(merged, row_max, temperature)
    probs = torch.where(kept, probs / total[:, None], torch.zeros_like(probs))
    return top_p_histogram.last_kept(merged, probs, kept, top_p)
