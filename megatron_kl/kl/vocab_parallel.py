"""Vocab-parallel token log-probs, entropy and exact KL(pi_theta || pi_ref) over TP shards.

Each rank of ``tp_group`` holds the logits of its vocabulary slice ``[r*V/tp, (r+1)*V/tp)`` (Megatron's
convention; the padded vocabulary). Nothing gathers the vocabulary. Per position, with z = logits / tau:

    log pi(a) = z_a - M - log S,                      M = max_a z_a (all-reduce MAX),
                                                     S = sum_a exp(z_a - M) (all-reduce SUM)
    H         = log S - E_pi[z - M]                   (partial sums all-reduced)
    KL        = E_pi[(z - M) - (r - M_r)] - log S + log S_r,    r = reference_logits / tau

Gradients w.r.t. the local logits slice, from the globally reduced quantities (no gradient all-reduce,
the slices are disjoint; the upstream gradient of these replicated outputs is NOT summed across ranks):

    d log pi(t) / dz_a = 1[a = t] - pi_a
    d H / dz_a         = -pi_a (log pi_a + H)
    d KL / dz_a        = pi_a (log pi_a - log pi_ref_a - KL)

each divided by tau for the gradient w.r.t. the logits. Work is chunked over tokens: extra memory is
O(chunk x V/tp) in float32 (default chunk: about 2M entries, i.e. 2M / (V/tp) rows), and the softmax is recomputed in backward instead of being saved.
Math runs in float32 for half-precision inputs and in float64 for float64 inputs. Entries at global
index >= ``vocab_size`` (Megatron's vocabulary padding) are excluded everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_CHUNK = None  # auto: rows such that one float32 chunk temporary is about CHUNK_ELEMENTS entries
CHUNK_ELEMENTS = 1 << 21


def _group_size_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Shard:
    """Where this rank's slice sits in the global vocabulary and how much of it is real."""

    start: int  # global index of the first local column
    valid: int  # local columns below vocab_size (the rest is padding)


def _shard(local_vocab: int, group, vocab_size: Optional[int]) -> _Shard:
    world, rank = _group_size_rank(group)
    start = rank * local_vocab
    total = vocab_size if vocab_size is not None else local_vocab * world
    if total > local_vocab * world:
        raise ValueError(f"vocab_size={total} exceeds the sharded vocabulary {local_vocab} x {world}")
    return _Shard(start=start, valid=max(0, min(local_vocab, total - start)))


def _scaled(chunk: torch.Tensor, shard: _Shard, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    return chunk[:, : shard.valid].to(dtype) / temperature


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products of two [n, V] tensors as batched BLAS dots: no [n, V] product temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


KEEP_BLOCK = 8192  # columns per block of chunk_forward(keep=...)'s reference exp-sum


def chunk_forward(z, r, targets, shard: _Shard, group, dtype, keep: Optional[list] = None):
    """Globally reduced statistics of one chunk of rows.

    ``z`` / ``r``: this rank's valid columns of the policy / reference logits divided by tau, in the
    compute ``dtype`` (``r`` may be None); both are overwritten. ``targets``: global ids of the chunk's
    rows (or None). Returns ``out [3, n]`` (log-prob of the target, entropy, KL) and ``norms [4, n]``
    (M, log S, M_ref, log S_ref), the normalisers ``chunk_grad`` needs. ``keep``: a list that receives
    ``[z - M, exp(z - M), r - M_ref]`` (``r`` then left as ``r - M_ref``) for a gradient in the same pass.
    """
    n = z.shape[0]
    maxes = torch.full((2, n), torch.finfo(dtype).min, dtype=dtype, device=z.device)
    if shard.valid:
        maxes[0] = z.max(dim=-1).values
        if r is not None:
            maxes[1] = r.max(dim=-1).values
    _all_reduce(maxes, dist.ReduceOp.MAX, group)
    zc = z.sub_(maxes[0, :, None])  # z - M <= 0
    e = torch.exp(zc)
    sums = torch.zeros(5, n, dtype=dtype, device=z.device)
    sums[0] = e.sum(-1)  # S
    sums[1] = _rowdot(e, zc)  # S * E_pi[z - M]
    if r is not None:
        rc = r.sub_(maxes[1, :, None])
        sums[3] = _rowdot(e, rc)  # S * E_pi[r - M_ref]
        if keep is None:
            sums[2] = rc.exp_().sum(-1)  # S_ref
        else:  # r - M_ref stays for the gradient: exp-sum by column blocks, no second [n, V] buffer
            sums[2] = sum(torch.exp(rc[:, j : j + KEEP_BLOCK]).sum(-1) for j in range(0, rc.shape[1], KEEP_BLOCK))
    if targets is not None and shard.valid:
        local_t = targets - shard.start
        owned = (local_t >= 0) & (local_t < shard.valid)
        picked = zc.gather(-1, local_t.clamp(0, shard.valid - 1).unsqueeze(-1)).squeeze(-1)
        sums[4] = torch.where(owned, picked, torch.zeros_like(picked))
    _all_reduce(sums, dist.ReduceOp.SUM, group)
    out = torch.zeros(3, n, dtype=dtype, device=z.device)
    norms = torch.zeros(4, n, dtype=dtype, device=z.device)
    log_s = torch.log(sums[0])
    mean_zc = sums[1] / sums[0]
    out[0] = sums[4] - log_s
    out[1] = log_s - mean_zc
    norms[0], norms[1] = maxes[0], log_s
    if r is not None:
        log_s_ref = torch.log(sums[2])
        out[2] = mean_zc - sums[3] / sums[0] - log_s + log_s_ref
        norms[2], norms[3] = maxes[1], log_s_ref
    if keep is not None:
        keep[:] = [zc, e, rc if r is not None else None]
    return out, norms


def chunk_grad(z, r, targets, shard: _Shard, norms, out, g_lp, g_h, g_kl, temperature, p=None):
    """Gradient w.r.t. this rank's valid logit columns of one chunk (see the module docstring).

    ``z`` / ``r`` as in ``chunk_forward`` (overwritten); ``norms`` / ``out`` its results for these rows;
    ``g_lp`` / ``g_h`` / ``g_kl``: upstream gradients [n] in the compute dtype (None when absent).
    ``p``: the softmax of these rows when already at hand (overwritten), else computed here.
    """
    # grad_z = p * [-g_lp - g_H (log p + H) + g_KL (log p - log q - KL)] + g_lp * onehot(target), in place
    log_p = z.sub_((norms[0] + norms[1])[:, None])
    p = torch.exp(log_p) if p is None else p
    kl_part = None
    if g_kl is not None and r is not None:  # g_KL * ((log p - log q) - KL): large |log q| cancels first
        kl_part = r.sub_((norms[2] + norms[3])[:, None])  # log q
        kl_part.neg_().add_(log_p).sub_(out[2, :, None]).mul_(g_kl[:, None])
    bracket = log_p.add_(out[1, :, None])  # log p + H
    if g_h is not None:
        bracket.mul_(-g_h[:, None])
    else:
        bracket.zero_()
    if g_lp is not None:
        bracket.sub_(g_lp[:, None])
    if kl_part is not None:
        bracket.add_(kl_part)
    grad = p.mul_(bracket)
    if g_lp is not None and targets is not None:
        local_t = targets - shard.start
        owned = (local_t >= 0) & (local_t < shard.valid)
        idx = owned.nonzero().squeeze(-1)
        grad[idx, local_t[idx]] += g_lp[idx]
    return grad if temperature == 1.0 else grad.div_(temperature)


def upstream(grad: Optional[torch.Tensor], lo: int, hi: int, dtype) -> Optional[torch.Tensor]:
    return None if grad is None else grad[lo:hi].to(dtype)


class _VocabParallelStats(torch.autograd.Function):
    """Forward: (logprob of target, entropy, KL to reference) per row; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, reference_logits, targets, group, temperature, vocab_size, chunk_size, inplace_backward):
        rows, local_vocab = logits.shape
        shard = _shard(local_vocab, group, vocab_size)
        dtype = compute_dtype(logits.dtype)
        out = torch.empty(3, rows, dtype=dtype, device=logits.device)  # logprob, entropy, kl
        norms = torch.empty(4, rows, dtype=dtype, device=logits.device)
        for lo in range(0, rows, chunk_size):
            hi = min(rows, lo + chunk_size)
            z = _scaled(logits[lo:hi], shard, temperature, dtype)
            r = _scaled(reference_logits[lo:hi], shard, temperature, dtype) if reference_logits is not None else None
            tgt = targets[lo:hi] if targets is not None else None
            out[:, lo:hi], norms[:, lo:hi] = chunk_forward(z, r, tgt, shard, group, dtype)
        ctx.save_for_backward(logits, reference_logits, targets, norms, out)
        ctx.shard, ctx.temperature, ctx.chunk_size, ctx.dtype = shard, temperature, chunk_size, dtype
        ctx.inplace_backward = inplace_backward
        ctx.mark_non_differentiable(norms)
        return out[0], out[1], out[2]

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_kl):
        logits, reference_logits, targets, norms, out = ctx.saved_tensors
        shard, tau, dtype = ctx.shard, ctx.temperature, ctx.dtype
        # In place: each chunk's gradient overwrites that chunk of the logits once it has been read, so
        # backward allocates nothing of full size (as megatron's vocab-parallel cross entropy does).
        grad_logits = logits if ctx.inplace_backward else torch.zeros_like(logits)
        if targets is None:
            grad_logprob = None
        if reference_logits is None:
            grad_kl = None
        rows = logits.shape[0]
        for lo in range(0, rows, ctx.chunk_size):
            hi = min(rows, lo + ctx.chunk_size)
            if shard.valid < logits.shape[1]:
                grad_logits[lo:hi, shard.valid:] = 0
            if shard.valid == 0:
                continue
            z = _scaled(logits[lo:hi], shard, tau, dtype)
            r = _scaled(reference_logits[lo:hi], shard, tau, dtype) if grad_kl is not None else None
            grad = chunk_grad(
                z, r, targets[lo:hi] if targets is not None else None, shard, norms[:, lo:hi], out[:, lo:hi],
                upstream(grad_logprob, lo, hi, dtype), upstream(grad_entropy, lo, hi, dtype),
                upstream(grad_kl, lo, hi, dtype), tau,
            )
            grad_logits[lo:hi, : shard.valid] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None, None, None, None


@dataclass
class VocabParallelStats:
    """Per-position outputs of one fused pass; shapes are the logits' leading dims."""

    logprobs: Optional[torch.Tensor]
    entropy: torch.Tensor
    kl: Optional[torch.Tensor]


def fused_stats(
    logits: torch.Tensor,
    tp_group,
    targets: Optional[torch.Tensor] = None,
    reference_logits: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: int = DEFAULT_CHUNK,
    inplace_backward: bool = False,
) -> VocabParallelStats:
    """Token log-prob (if ``targets``), entropy and exact KL to the reference (if ``reference_logits``)
    from one pass over the local logits slice ``[..., V/tp]``, sharing one normaliser.

    Differentiable w.r.t. ``logits`` only. ``targets`` are global token ids. ``vocab_size`` is the true
    vocabulary (padding excluded); default: the whole sharded vocabulary. ``inplace_backward=True``
    writes the gradient into the logits' storage (no full-size allocation in backward): use it only when
    the logits are a temporary that nothing reads after backward, as in the training loss.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0 (or None for automatic)")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    ref = None
    if reference_logits is not None:
        if reference_logits.shape != logits.shape:
            raise ValueError(
                f"reference_logits shape {tuple(reference_logits.shape)} != logits {tuple(logits.shape)}; "
                "policy and reference must share the TP layout (reshard the reference to the policy's TP size)"
            )
        ref = reference_logits.detach().reshape(-1, logits.shape[-1])
    tgt = targets.reshape(-1).long() if targets is not None else None
    logprob, ent, kl = _VocabParallelStats.apply(
        flat, ref, tgt, tp_group, float(temperature), vocab_size, chunk_size, inplace_backward
    )
    return VocabParallelStats(
        logprobs=logprob.reshape(lead) if targets is not None else None,
        entropy=ent.reshape(lead),
        kl=kl.reshape(lead) if reference_logits is not None else None,
    )


def token_logprobs(logits, targets, tp_group, temperature=1.0, vocab_size=None, chunk_size=DEFAULT_CHUNK):
    """log softmax(logits / temperature)[target] over the full (sharded) vocabulary."""
    return fused_stats(logits, tp_group, targets=targets, temperature=temperature,
                       vocab_size=vocab_size, chunk_size=chunk_size).logprobs


def entropy(logits, tp_group, temperature=1.0, vocab_size=None, chunk_size=DEFAULT_CHUNK):
    """-sum_a pi(a) log pi(a) of softmax(logits / temperature) over the full vocabulary."""
    return fused_stats(logits, tp_group, temperature=temperature,
                       vocab_size=vocab_size, chunk_size=chunk_size).entropy


def full_kl(logits, reference_logits, tp_group, temperature=1.0, vocab_size=None, chunk_size=DEFAULT_CHUNK):
    """Exact KL(pi_theta || pi_ref) per position; differentiable w.r.t. ``logits`` only."""
    return fused_stats(logits, tp_group, reference_logits=reference_logits, temperature=temperature,
                       vocab_size=vocab_size, chunk_size=chunk_size).kl
