"""Vocab-parallel statistics at given token ids: a model's top-k (ids and log-probs) and the logits at k ids per row.

Each rank of ``tp_group`` holds the columns ``[r*V/tp, (r+1)*V/tp)`` of the (padded) vocabulary, as in
:mod:`megatron_kl.vocab_parallel.stats`. Nothing gathers the vocabulary:

- :func:`top_k_logprobs` (no gradient): each rank's k largest valid logits, all-gathered (k x tp candidates per
  row) and cut to the global k; their log-probs log softmax(x / tau) with the normaliser reduced over the group
  (max, then sum of exp). Among exactly equal logits the ids chosen are torch.topk's (not specified).
- :func:`candidate_logits` (differentiable): the logits ``x [..., k]`` at global ids, each entry from the rank that
  owns it, summed over the group; backward hands each rank the gradient of its own entries (megatron's
  reduce-from-tensor-parallel region).
- :func:`fused_candidate_logits` (differentiable): the same from final hidden states and this rank's output-weight
  shard, ``x_j = h . W[id_j]``, in chunks of rows, so no [rows, V/tp] logits and no [rows, k, H] gathered weight
  beyond one chunk are held; backward recomputes the chunk's gathered rows. dL/dh is this rank's partial sum (its
  vocabulary's ids), to be reduced by the output layer's own TP collective, as the fused-linear path's is.

With the sampled token's log-prob log pi(y) from the main sweep, log pi(j) = log pi(y) + (x_j - x_y) / tau: the
log-probs at k ids cost k logits, not another pass over the vocabulary, and their gradient
(1[a = j] - pi_a) / tau comes out exactly (the -pi_a / tau part through log pi(y)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kl.vocab_parallel.fused_linear import weight_grad_for_autograd
from megatron_kl.vocab_parallel.groups import all_reduce, group_size_rank

CANDIDATE_CHUNK_ROWS = 4096  # rows per chunk of fused_candidate_logits (k x H gathered weight rows each)


def _owned(ids: torch.Tensor, local_vocab: int, group, vocab_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(local column clamped into the shard, whether this rank owns the id) of global ``ids``."""
    world, rank = group_size_rank(group)
    start = rank * local_vocab
    total = vocab_size if vocab_size is not None else local_vocab * world
    local = ids.long() - start
    owned = (local >= 0) & (local < local_vocab) & (ids < total)
    return local.clamp(0, local_vocab - 1), owned


@torch.no_grad()
def top_k_logprobs(
    logits: torch.Tensor, k: int, group, temperature: float = 1.0, vocab_size=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [..., k] int64, log-probs [..., k] float32/64) of the ``k`` most likely tokens of softmax(logits / tau)
    over the sharded vocabulary (``logits [..., V/tp]`` this rank's columns; padding beyond ``vocab_size`` never
    chosen). Collective over ``group``."""
    world, rank = group_size_rank(group)
    local_vocab = logits.shape[-1]
    total = vocab_size if vocab_size is not None else local_vocab * world
    if not 1 <= k <= total:
        raise ValueError(f"top-k of k={k} over a vocabulary of {total}: use 1 <= k <= the vocabulary")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lead = logits.shape[:-1]
    x = logits.reshape(-1, local_vocab).to(dtype) / temperature
    valid = max(0, min(local_vocab, total - rank * local_vocab))
    x = x[:, :valid]
    rows = x.shape[0]
    low = torch.finfo(dtype).min
    # the normaliser over every rank's valid columns
    maxes = x.amax(-1) if valid else torch.full((rows,), low, dtype=dtype, device=x.device)
    all_reduce(maxes, dist.ReduceOp.MAX, group)
    sums = (x - maxes[:, None]).exp().sum(-1) if valid else torch.zeros(rows, dtype=dtype, device=x.device)
    all_reduce(sums, dist.ReduceOp.SUM, group)
    log_normaliser = maxes + sums.log()
    take = min(k, valid)
    values = torch.full((rows, k), low, dtype=dtype, device=x.device)
    ids = torch.full((rows, k), total, dtype=torch.long, device=x.device)  # past the vocabulary: never chosen
    if take:
        top = x.topk(take, dim=-1)
        values[:, :take], ids[:, :take] = top.values, top.indices + rank * local_vocab
    if world > 1:
        gathered_values = [torch.empty_like(values) for _ in range(world)]
        gathered_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(gathered_values, values.contiguous(), group=group)
        dist.all_gather(gathered_ids, ids.contiguous(), group=group)
        values, ids = torch.cat(gathered_values, -1), torch.cat(gathered_ids, -1)
    best = values.topk(k, dim=-1).indices
    values, ids = values.gather(-1, best), ids.gather(-1, best)
    return ids.reshape(*lead, k), (values - log_normaliser[:, None]).reshape(*lead, k)


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over ``group`` of each rank's tensor; backward: the gradient as it is (each rank's
    contribution enters the sum once)."""

    @staticmethod
    def forward(ctx, tensor, group):
        return all_reduce(tensor.clone(), dist.ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def candidate_logits(logits: torch.Tensor, ids: torch.Tensor, group, vocab_size=None) -> torch.Tensor:
    """The logits ``[..., k]`` (this dtype, not divided by tau) at global ``ids [..., k]`` from the sharded
    ``logits [..., V/tp]``; differentiable w.r.t. ``logits``. Collective over ``group``."""
    local, owned = _owned(ids, logits.shape[-1], group, vocab_size)
    picked = logits.gather(-1, local)
    return _SumOverGroup.apply(torch.where(owned, picked, torch.zeros_like(picked)), group)


class _FusedCandidateLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, local, owned, group, chunk_rows):
        rows, k = local.shape
        out = torch.zeros(
            rows, k, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32, device=hidden.device
        )
        for lo in range(0, rows, chunk_rows):
            part = slice(lo, min(rows, lo + chunk_rows))
            gathered = weight[local[part]]  # [c, k, H]
            out[part] = torch.bmm(gathered, hidden[part, :, None].to(weight.dtype))[..., 0].to(out.dtype)
        out *= owned
        all_reduce(out, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(hidden, weight, local, owned)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, local, owned = ctx.saved_tensors
        grad = grad * owned  # only this rank's entries came from its weight shard
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(
                weight.shape,
                dtype=torch.float64 if weight.dtype == torch.float64 else torch.float32,
                device=weight.device,
            )
        for lo in range(0, local.shape[0], ctx.chunk_rows):
            part = slice(lo, min(local.shape[0], lo + ctx.chunk_rows))
            g = grad[part]
            if grad_hidden is not None:
                gathered = weight[local[part]].to(g.dtype)
                grad_hidden[part] = torch.bmm(g[:, None, :], gathered)[:, 0].to(hidden.dtype)
            if grad_weight is not None:
                h = hidden[part].to(grad_weight.dtype)
                grad_weight.index_add_(
                    0,
                    local[part].reshape(-1),
                    (g[..., None].to(grad_weight.dtype) * h[:, None, :]).reshape(-1, h.shape[-1]),
                )
        if grad_weight is not None:
            grad_weight = weight_grad_for_autograd(weight, grad_weight)
        return grad_hidden, grad_weight, None, None, None, None


def fused_candidate_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    group,
    vocab_size=None,
    chunk_rows: int = CANDIDATE_CHUNK_ROWS,
) -> torch.Tensor:
    """The logits ``[..., k]`` (float32, or float64 for float64 inputs) at global ``ids [..., k]`` from final hidden
    states ``hidden [..., H]`` and this rank's output-weight shard ``weight [V/tp, H]``; differentiable w.r.t. both
    (dL/dh this rank's partial sum: reduce it with the output layer's collective). Collective over ``group``."""
    lead, k = ids.shape[:-1], ids.shape[-1]
    if tuple(hidden.shape[:-1]) != tuple(lead):
        raise ValueError(f"hidden {tuple(hidden.shape)} and ids {tuple(ids.shape)} disagree on the leading shape")
    local, owned = _owned(ids.reshape(-1, k), weight.shape[0], group, vocab_size)
    out = _FusedCandidateLogits.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        local,
        owned.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32),
        group,
        chunk_rows,
    )
    return out.reshape(*lead, k)


def candidate_logprobs(
    sampled_logprobs: torch.Tensor, candidate: torch.Tensor, sampled: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(j) [..., k] at the candidate ids from the sampled token's log-prob ``sampled_logprobs [...]`` and the
    raw logits at the candidates ``candidate [..., k]`` and at the sampled token ``sampled [...]`` (module
    docstring): log pi(y) + (x_j - x_y) / tau, the differences formed in the compute dtype."""
    dtype = torch.float64 if sampled_logprobs.dtype == torch.float64 else torch.float32
    shift = (candidate.to(dtype) - sampled.to(dtype)[..., None]) / temperature
    return sampled_logprobs.to(dtype)[..., None] + shift
