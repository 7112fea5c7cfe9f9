"""The token axis of the loss side's [B, T] tensors, whole on one rank or sharded over a context-parallel group.

Every quantity of the KL objective that is not per token reads the sequence through five reductions:

    seq_sum(x)_b      = sum_t x_bt                      (the sequence estimators' D, GSPO's mean log-ratio,
                                                          sequence IS, geometric masks, per-sequence counts)
    prefix(x)_bt      = sum_{s<=t} x_bs                 (per-decision weights rho_{1:t}: exp of a prefix sum)
    suffix(x)_bt      = sum_{s>=t} x_bs                 (reward-to-go credit, the Rao-Blackwellised exact
                                                          sequence KL's sum over later positions)
    total(x)          = sum_{b,t} x_bt                  (aggregations' numerators and token counts)
    maximum / minimum (metrics only, no gradient)

``LOCAL`` computes them with torch ops on a whole sequence. ``ContextParallelAxis`` computes them on the shard
a context-parallel rank holds in megatron-core's zigzag layout: the sequence (padded to a multiple of 2 cp)
split into 2 cp chunks, rank r holding chunks r and 2cp-1-r, concatenated (``zigzag_shard``). Sums are
all-reduced; prefix and suffix sums add to each local chunk's own cumulative sum the exclusive scan of the
chunks' totals in sequence order, from one all-gather of two partials per sequence and rank - never the
sequence itself. Both collectives are differentiable: their backward all-reduces the gradients, so a loss
built only from these reductions has the same value on every CP rank (every logged metric too), and
back-propagating ``loss * share`` (share = 1 / cp) on each rank gives each rank exactly its shard of the
single-rank gradient (d/dx_r of sum_q L / cp = dL/dx_r). A trainer whose gradient all-reduce averages over the
data- and context-parallel ranks (megatron-core's DDP) back-propagates ``loss`` itself.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class SequenceAxis:
    """The whole sequence on this rank (``LOCAL``)."""

    size = 1  # context-parallel ranks
    rank = 0
    share = 1.0  # what each rank back-propagates of the (replicated) loss: 1 / size

    @property
    def counts_sequences(self) -> bool:
        """Whether this rank counts per-sequence events (clamped sequence log-ratios): one rank of the group."""
        return self.rank == 0

    def seq_sum(self, x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
        return x.sum(-1, keepdim=keepdim)

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(-1)

    def suffix(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1).cumsum(-1).flip(-1)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    def maximum(self, x: torch.Tensor) -> torch.Tensor:
        return x.max() if x.numel() else torch.full((), -torch.inf, dtype=x.dtype)

    def minimum(self, x: torch.Tensor) -> torch.Tensor:
        return x.min() if x.numel() else torch.full((), torch.inf, dtype=x.dtype)

    def __repr__(self) -> str:
        return "SequenceAxis(local)"


LOCAL = SequenceAxis()


class _AllReduceSum(torch.autograd.Function):
    """sum over the group; backward: the gradients summed over the group (every rank's loss reads the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllGather(torch.autograd.Function):
    """[...] per rank -> [size, ...]; backward: the gradients summed over the group, this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class ContextParallelAxis(SequenceAxis):
    """This rank's zigzag shard [B, 2 L] (chunks ``rank`` and ``2 size - 1 - rank`` of length L, in that order) of
    sequences sharded over ``group`` (module docstring)."""

    def __init__(self, group, size: Optional[int] = None, rank: Optional[int] = None):
        self.group = group
        self.size = dist.get_world_size(group) if size is None else size
        self.rank = dist.get_rank(group) if rank is None else rank
        self.share = 1.0 / self.size

    def __repr__(self) -> str:
        return f"ContextParallelAxis(rank {self.rank} of {self.size}, zigzag)"

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(x, self.group) if self.size > 1 else x

    def _halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] % 2:
            raise ValueError(
                f"a context-parallel shard holds two chunks of equal length; got {x.shape[-1]} "
                "positions (pad sequences to a multiple of 2 x context_parallel: zigzag_shard)"
            )
        half = x.shape[-1] // 2
        return x[..., :half], x[..., half:]

    def _chunk_totals(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 size]: every chunk's sum, in sequence order (one all-gather of [..., 2] per rank)."""
        first, second = self._halves(x)
        mine = torch.stack([first.sum(-1), second.sum(-1)], -1)
        every = _AllGather.apply(mine, self.group, self.rank, self.size) if self.size > 1 else mine[None]
        # rank q holds chunks q and 2 size - 1 - q
        early = [every[q][..., 0] for q in range(self.size)]
        late = [every[q][..., 1] for q in reversed(range(self.size))]
        return torch.stack(early + late, -1)

    def seq_sum(self, x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
        return self._sum(x.sum(-1, keepdim=keepdim))

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        totals = self._chunk_totals(x)
        before = totals.cumsum(-1) - totals  # sum of the chunks ahead of each chunk
        first, second = self._halves(x)
        late = 2 * self.size - 1 - self.rank
        return torch.cat(
            [first.cumsum(-1) + before[..., self.rank, None], second.cumsum(-1) + before[..., late, None]], -1
        )

    def suffix(self, x: torch.Tensor) -> torch.Tensor:
        totals = self._chunk_totals(x)
        after = LOCAL.suffix(totals) - totals  # sum of the chunks behind each chunk
        first, second = self._halves(x)
        late = 2 * self.size - 1 - self.rank
        return torch.cat(
            [LOCAL.suffix(first) + after[..., self.rank, None], LOCAL.suffix(second) + after[..., late, None]], -1
        )

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return self._sum(x.sum())

    def maximum(self, x: torch.Tensor) -> torch.Tensor:
        out = LOCAL.maximum(x.detach()).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def minimum(self, x: torch.Tensor) -> torch.Tensor:
        out = LOCAL.minimum(x.detach()).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MIN, group=self.group)
        return out


def padded_length(length: int, size: int) -> int:
    """``length`` rounded up to a multiple of 2 x ``size`` (the zigzag layout's chunk count)."""
    chunks = 2 * size
    return -(-length // chunks) * chunks


def zigzag_positions(length: int, size: int, rank: int) -> torch.Tensor:
    """The positions (of the sequence padded to ``padded_length``) that rank ``rank`` of ``size`` holds, in its
    local order: chunk ``rank`` then chunk ``2 size - 1 - rank``."""
    chunk = padded_length(length, size) // (2 * size)
    late = 2 * size - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(late * chunk, (late + 1) * chunk)])


def zigzag_shard(x: torch.Tensor, size: int, rank: int, pad_value=0) -> torch.Tensor:
    """Rank ``rank``'s shard of [..., T] (padded with ``pad_value`` to a multiple of 2 size along the last dim)."""
    length = x.shape[-1]
    padding = padded_length(length, size) - length
    if padding:
        x = torch.nn.functional.pad(x, (0, padding), value=pad_value)
    return x[..., zigzag_positions(length, size, rank).to(x.device)]


def zigzag_unshard(shards: list[torch.Tensor], length: int) -> torch.Tensor:
    """The ranks' shards (rank order) back to [..., length] in sequence order (padding dropped)."""
    size = len(shards)
    out = shards[0].new_zeros(*shards[0].shape[:-1], padded_length(length, size))
    for rank, shard in enumerate(shards):
        out[..., zigzag_positions(length, size, rank).to(out.device)] = shard
    return out[..., :length]


SEQUENCE_CORRECTIONS = ("sequence_tis", "sequence_mask", "geometric_mask")  # weights read the whole sequence


def crossing(kl, correction: Optional[str] = None) -> tuple[str, ...]:
    """What a KL configuration (``KLConfig``; ``correction``: the behaviour correction whose weights it carries with
    ``off_policy='behavior'``) needs from the other CP ranks beyond the aggregation's per-sequence sums and token
    counts (which every term all-reduces): ``sum`` - a per-sequence sum fed to a non-linear function (the sequence
    estimators' D, the exact sequence KL's total, a sequence correction's log W or mean weight), all-reduced;
    ``prefix`` / ``suffix`` - cumulative sums over earlier / later positions (per-decision weights exp(prefix of log
    rho); reward-to-go credit and the Rao-Blackwellised sum over later positions), from one all-gather of two chunk
    totals per sequence and rank and an exclusive scan in sequence order."""
    needs = []
    if kl.level == "sequence" and not (kl.exact and kl.placement == "loss"):
        needs.append("sum")
    if kl.off_policy == "per_decision":
        needs.append("prefix")
    if (kl.level == "sequence" and kl.exact and kl.placement == "loss") or kl.effective_credit == "reward_to_go":
        needs.append("suffix")
    if kl.off_policy == "behavior" and (correction in SEQUENCE_CORRECTIONS or kl.level == "sequence"):
        needs.append("sum")
    return tuple(dict.fromkeys(needs))
