"""Vocab-parallel token log-probs, entropy and exact KL(pi_theta || pi_ref) over TP shards.

Each rank of ``tp_group`` holds the logits of its vocabulary slice ``[r*V/tp, (r+1)*V/tp)`` (Megatron's
convention; the padded vocabulary). Nothing gathers the vocabulary. Per position, with x / y the policy /
reference logits, tau the temperature, M = max_a x_a and M_r = max_a y_a (all-reduce MAX):

    zc_a = (x_a - M) / tau <= 0,   e_a = exp(zc_a),   S = sum_a e_a        (all-reduce SUM)
    log pi(t) = zc_t - log S
    H         = log S - E_pi[zc]
    KL        = E_pi[u] + log1p(E_pi[expm1(-u)]),   u_a = ((x_a - y_a) - (M - M_r)) / tau

The KL form is the identity log pi - log pi_ref = u + log E_pi[exp(-u)] (u is the log-ratio up to a
constant per row). Near the reference u = O(eps), both terms are O(eps) and the per-token differences
are formed before any sum, so the error scales with the KL instead of with log S ~ 10 (the textbook
E[z - M] - E[r - M_r] - log S + log S_r cancels four O(10) terms: absolute error ~1e-5 in fp32, i.e.
relative error 30 at KL 5e-7). Per token, e_a * expm1(-u_a) = exp(r_a - M_r) - exp(z_a - M); where
-u_a > KL_DIRECT (the reference puts mass where the policy has next to none) the right-hand side is
used instead, so nothing overflows.

Gradients w.r.t. the local logits slice, from the globally reduced quantities (no gradient all-reduce,
the slices are disjoint; the upstream gradient of these replicated outputs is NOT summed across ranks):

    d log pi(t) / dx_a = (1[a = t] - pi_a) / tau
    d H / dx_a         = -pi_a (zc_a - E_pi[zc]) / tau        (= -pi_a (log pi_a + H) / tau)
    d KL / dx_a        =  pi_a (u_a - E_pi[u]) / tau           (= pi_a (log pi_a - log pi_ref_a - KL) / tau)

with pi_a = e_a / S: every bracket is a difference of two centred quantities (no log S, no M + log S
formed in fp32 next to logits of 1e4). Work is chunked over rows: extra memory is O(chunk x V/tp) in the
compute dtype, and the softmax is recomputed in backward instead of being saved. Only the requested
statistics are computed (``token_logprobs`` does no entropy work). Row sums are plain reductions (pairwise
summation), not BLAS dot products, whose sequential accumulation is ~80x less accurate on CPU.
Math runs in float32 for half-precision inputs and in float64 for float64 inputs. Entries at global
index >= ``vocab_size`` (Megatron's vocabulary padding) are excluded everywhere.

Truncated policy (``truncation``: top-k / top-p, the support {x_a >= t} found by ``vocab_parallel.truncation``): e_a is
set to 0 off the support, so S, E[zc], E[u] and every gradient above are those of mu = e / S_support; the KL is
to the full reference, KL(mu || pi_ref) = E_mu[u] + log(S_ref / S_support) with
S_ref - S_support = sum_all e_a expm1(-u_a) + sum_off-support e_a (both terms formed directly, so the error
still scales with the KL); masks are float multipliers (a bool pass costs ~3x a float one on CPU).

Automatic chunk size (``chunk_size=None``): ``CHUNK_ELEMENTS // (V/tp)`` rows, at least one. Measured with
``tools/bench_vocab_parallel.py --section chunks`` (2 CPU cores, 32 MiB L3, 4096 x 32768 fp32, fwd+bwd in
place): 2^20 entries per chunk (4 MiB per buffer; the few live buffers stay in L3) is fastest or within
5 % of it for log-probs, log-probs + entropy and the exact KL; 2^23 and more run 2-4x slower (every pass
goes to DRAM), 2^18 ~25 % slower (per-chunk Python and collective overhead). On CUDA devices the rule
is ``CUDA_CHUNK_ELEMENTS`` (2^24). On one H200 (docs/gpu.md) the log-probs at 8192 x 152064 took 3.4x
megatron-core's time at 0.03x its memory: every elementwise pass goes to HBM there, so the pass count, not the
chunk size, sets the GPU time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_kl.vocab_parallel import triton_stats
from megatron_kl.vocab_parallel.chunks import MAX, MEAN_U, MEAN_ZC, SHIFT, SUM, Kept, Rows, Shard, Sweep, Upstream, cut
from megatron_kl.vocab_parallel.groups import all_reduce, group_size_rank
from megatron_kl.vocab_parallel.truncation import Truncation, effective, find_support

DEFAULT_CHUNK = None  # auto: rows such that one chunk temporary is about CHUNK_ELEMENTS entries
CHUNK_ELEMENTS = 1 << 20  # CPU, measured (module docstring)
CUDA_CHUNK_ELEMENTS = 1 << 24  # GPU: fewer, larger chunks amortise kernel launches (docs/gpu.md)
KL_DIRECT = 60.0  # -u above this: exp(r - M_r) directly (e * expm1(-u) could overflow as 0 * inf)

# rows of the per-position partial sums reduced over the TP group (``sums``): S = sum_a e_a, S E[zc], S E[u],
# sum_a (e_ref - e), the target's zc; with a truncated support also S of the full softmax, the support's size and
# whether the target lies outside it
S, S_ZC, S_U, REF_MINUS_POLICY, TARGET_ZC, FULL_S, SUPPORT_SIZE, TARGET_OUT = range(8)


def check_group(group, name: str = "tp_group") -> None:
    """``None`` means TP=1; refuse it where a multi-rank job would silently compute per-shard results."""
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{name}=None while torch.distributed runs {dist.get_world_size()} ranks: pass the tensor-parallel "
            "group (megatron's parallel_state.get_tensor_model_parallel_group(), or a one-rank group for TP=1)"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_rows(local_vocab: int, device: Optional[torch.device] = None) -> int:
    """Rows per cache-sized block of the softmax passes: about CHUNK_ELEMENTS (CUDA_CHUNK_ELEMENTS on a GPU)
    logits per block (the fused-linear path's chunks of logits are another size: fused_linear.linear_chunk_rows)."""
    elements = CUDA_CHUNK_ELEMENTS if device is not None and device.type == "cuda" else CHUNK_ELEMENTS
    return max(1, elements // max(1, local_vocab))


def _shard(local_vocab: int, group, vocab_size: Optional[int]) -> Shard:
    world, rank = group_size_rank(group)
    start = rank * local_vocab
    total = vocab_size if vocab_size is not None else local_vocab * world
    if total > local_vocab * world:
        raise ValueError(f"vocab_size={total} exceeds the sharded vocabulary {local_vocab} x {world}")
    return Shard(start=start, valid=max(0, min(local_vocab, total - start)))


def chunk_forward(rows: Rows, sweep: Sweep, keep: Optional[Kept] = None, support: Optional[torch.Tensor] = None):
    """Globally reduced statistics of one chunk of ``rows`` (``x``, ``y`` in any float dtype, left intact unless
    ``sweep.scratch``: then both may be overwritten). Returns ``out [3, n]`` (log-prob of the target, entropy, KL;
    zero where not requested: no targets, ``sweep.entropy`` false, no ``y``) and ``norms [5, n]`` (M, M - M_r, S,
    E_pi[zc], E_pi[u]), all ``chunk_grad`` needs. ``keep``: receives what a gradient in the same pass reuses
    (:class:`Kept`; needs ``sweep.scratch``: zc and -u overwrite x and y). The elementwise work runs on blocks of
    rows of the automatic chunk size (cache-sized on CPU) between the chunk's two collectives.

    ``rows.threshold``: the policy is the truncated distribution mu = softmax(x / tau) restricted to
    ``{x >= threshold}`` and renormalised; every statistic is mu's (the KL is KL(mu || pi_ref) with the full
    reference), a target outside the support gets the extended log-prob zc_t - log S_support. ``support [3, n]``
    then receives the support's mass under the full distribution, its size and whether the target lies outside
    it (1.0 / 0.0).
    """
    if keep is not None and not sweep.scratch:
        raise ValueError("chunk_forward(keep=...) keeps zc and -u in x and y: use a Sweep with scratch=True")
    if triton_stats.enabled(rows.x):  # GPU (or Triton's interpreter): one read of x and y, the same collectives
        if keep is not None:  # the gradient re-reads x (and y) instead of keeping zc, e and -u
            keep.rows = rows
        return triton_stats.forward(rows, sweep, support)
    dtype = compute_dtype(rows.x.dtype)
    x = rows.x.to(dtype)
    y = rows.y.to(dtype) if rows.y is not None else None
    rows = dataclasses.replace(rows, x=x, y=y)
    n, cols = x.shape
    maxes = torch.full((2, n), torch.finfo(dtype).min, dtype=dtype, device=x.device)
    if rows.row_max is not None:
        maxes[0] = rows.row_max
    elif cols:
        maxes[0] = x.amax(-1)
    if cols and y is not None:
        maxes[1] = y.amax(-1)
    all_reduce(maxes, dist.ReduceOp.MAX, sweep.group)
    # S, S E[zc], S E[u], sum(e_ref - e), zc[target]; truncated: S of the full softmax, support size, target out
    sums = torch.zeros(5 if rows.threshold is None else 8, n, dtype=dtype, device=x.device)
    if cols:
        e_kept = sweep.workspace.get("e_kept", n, cols, dtype, x.device) if keep is not None else None
        block = block_rows(cols, x.device)
        for a in range(0, n, block):
            part = slice(a, min(n, a + block))
            _chunk_sums(rows[part], maxes[:, part], sums[:, part], sweep, cut(e_kept, part))
        if keep is not None:
            keep.zc, keep.e, keep.neg_u = x, e_kept, y
    all_reduce(sums, dist.ReduceOp.SUM, sweep.group)
    out = torch.zeros(3, n, dtype=dtype, device=x.device)
    norms = torch.zeros(5, n, dtype=dtype, device=x.device)
    total = sums[S]
    log_s = torch.log(total)
    norms[MAX], norms[SHIFT], norms[SUM] = maxes[0], maxes[0] - maxes[1], total
    if rows.targets is not None:
        out[0] = sums[TARGET_ZC] - log_s
    if sweep.entropy:
        norms[MEAN_ZC] = sums[S_ZC] / total
        out[1] = log_s - norms[MEAN_ZC]
    if y is not None:
        norms[MEAN_U] = sums[S_U] / total
        # E_pi[exp(-u)] - 1 > -1
        ratio_minus_one = (sums[REF_MINUS_POLICY] / total).clamp_min(torch.finfo(dtype).eps - 1.0)
        out[2] = (norms[MEAN_U] + torch.log1p(ratio_minus_one)).clamp_min(0.0)
    if support is not None and rows.threshold is not None:
        support[0] = total / sums[FULL_S]
        support[1] = sums[SUPPORT_SIZE]
        support[2] = sums[TARGET_OUT]
    return out, norms


def _chunk_sums(rows: Rows, maxes, sums, sweep: Sweep, e_kept=None) -> None:
    """This rank's partial sums of a block of ``rows`` (compute dtype) into ``sums`` (see ``chunk_forward``),
    relative to ``maxes [2, n]``; ``e_kept``: where exp(zc) goes when it is kept (then -u in y is kept too)."""
    x, y, threshold, ws = rows.x, rows.y, rows.threshold, sweep.workspace
    drop = None  # 1.0 outside the support, 0.0 inside (float: bool masks cost ~3x a float pass on CPU)
    if threshold is not None:  # before x may be overwritten
        drop = torch.lt(x, threshold[:, None], out=ws.like("drop", x))
    neg_u = None
    if y is not None:  # -u = ((y - x) + (M - M_r)) / tau: the log-ratio's differences first
        neg_u = torch.sub(y, x, out=y if sweep.scratch else ws.like("neg_u", x)).add_((maxes[0] - maxes[1])[:, None])
        if sweep.temperature != 1.0:
            neg_u.div_(sweep.temperature)
    zc = torch.sub(x, maxes[0, :, None], out=x if sweep.scratch else ws.like("zc", x))
    if sweep.temperature != 1.0:
        zc.div_(sweep.temperature)
    if rows.targets is not None:
        shard = sweep.shard
        local, owned = shard.owned(rows.targets)
        picked = zc.gather(-1, local.clamp(0, shard.valid - 1).unsqueeze(-1)).squeeze(-1)
        sums[TARGET_ZC] = torch.where(owned, picked, torch.zeros_like(picked))
        if drop is not None:
            out_of_support = drop.gather(-1, local.clamp(0, shard.valid - 1).unsqueeze(-1)).squeeze(-1)
            sums[TARGET_OUT] = torch.where(owned, out_of_support, torch.zeros_like(out_of_support))
    keep_zc = sweep.entropy or e_kept is not None or neg_u is not None or drop is not None
    product = ws.like("product", zc)
    e_out = ws.like("e", zc) if e_kept is None else e_kept
    # full: e of the full softmax; e: of the support only where truncated (else the same tensor)
    dropped = None  # the full softmax's e outside the support, summed directly (not as a difference of totals)
    if drop is not None:
        full = torch.exp(zc, out=ws.like("full", zc))
        e_dropped = torch.mul(full, drop, out=product)
        dropped = e_dropped.sum(-1)
        sums[SUPPORT_SIZE] = drop.shape[-1] - drop.sum(-1)
        e = torch.sub(full, e_dropped, out=e_out)  # exactly 0 outside the support
    else:
        e = full = torch.exp(zc, out=e_out) if keep_zc else zc.exp_()
    if neg_u is not None:
        sums[S_U] = -torch.mul(e, neg_u, out=product).sum(-1)
        w = neg_u if e_kept is None else ws.like("w", neg_u).copy_(neg_u)
        sums[REF_MINUS_POLICY] = _reference_minus_policy(zc, full, neg_u, w, product)
        if (
            drop is not None
        ):  # sum(e_ref - e_support) = sum_all e expm1(-u) [accurate near the reference] + sum_dropped e
            sums[REF_MINUS_POLICY] += dropped
    sums[S] = e.sum(-1)
    if dropped is not None:
        sums[FULL_S] = sums[S] + dropped  # S of the full softmax
    if sweep.entropy:
        product = torch.mul(e, zc, out=product)
        sums[S_ZC] = product.sum(-1)


def _reference_minus_policy(zc, e, neg_u, w, buffer) -> torch.Tensor:
    """Row sums of exp(r - M_r) - exp(z - M) = e * expm1(-u), formed per token (``w``: -u, overwritten;
    may be ``neg_u`` itself); where -u > KL_DIRECT (e may underflow while exp(-u) overflows) from
    exp(zc - u) directly."""
    far = None
    if bool(neg_u.amax() > KL_DIRECT):
        far = neg_u > KL_DIRECT
    direct = torch.exp(zc + neg_u) if far is not None else None
    if far is not None:
        w.clamp_(max=KL_DIRECT)
    delta = torch.mul(e, w.expm1_(), out=buffer)
    if far is not None:
        delta = torch.where(far, direct, delta)
    return delta.sum(-1)


def chunk_grad(
    rows: Rows, norms, upstream: Upstream, sweep: Sweep, out: Optional[torch.Tensor] = None, kept: Optional[Kept] = None
) -> torch.Tensor:
    """dL/dx for this rank's valid logit columns of one chunk of ``rows`` (module docstring), in the compute dtype.

    ``rows`` as in ``chunk_forward`` (read only; ``y`` only when ``upstream.kl`` is given); ``norms``: its row
    state for these rows. ``out``: where to write the result (compute dtype, may be ``rows.x`` itself: x is read
    before it is overwritten; required unless ``kept``). ``kept``: ``chunk_forward``'s keep for these rows (then x
    and y are not read; its buffers are overwritten and hold the result). Runs on cache-sized blocks of rows, as
    ``chunk_forward``; under ``rows.threshold`` the gradient is the truncated policy's (with ``kept`` the kept e
    is already zero outside the support).
    """
    if out is None and kept is None:
        raise ValueError("chunk_grad needs out= (or kept=)")
    if kept is not None and kept.rows is not None:  # chunk_forward ran the Triton kernels: x is scratch, write there
        forward = dataclasses.replace(kept.rows, targets=rows.targets)
        return triton_stats.backward(forward, norms, upstream, sweep, out=forward.x if out is None else out)
    if kept is None and triton_stats.enabled(rows.x):
        return triton_stats.backward(rows, norms, upstream, sweep, out=out)
    if kept is not None:
        rows = dataclasses.replace(rows, threshold=None)
    first = rows.x if rows.x is not None else kept.zc
    n, cols = first.shape
    block = block_rows(cols, first.device)
    for a in range(0, n, block):
        part = slice(a, min(n, a + block))
        _block_grad(
            rows[part], norms[:, part], upstream[part], sweep, cut(out, part), kept[part] if kept is not None else None
        )
    if out is not None:
        return out
    return kept.zc if upstream.entropy is not None else kept.e  # where _block_grad's in-place result lands


def _block_grad(rows: Rows, norms, upstream: Upstream, sweep: Sweep, out, kept: Optional[Kept]):
    """``chunk_grad`` on one block of rows."""
    x, y, threshold, ws, temperature = rows.x, rows.y, rows.threshold, sweep.workspace, sweep.temperature
    g_lp, g_h, g_kl = upstream.logprob, upstream.entropy, upstream.kl
    dtype = compute_dtype(x.dtype if x is not None else kept.zc.dtype)
    drop = None  # before out (maybe x) is written; float as in _chunk_sums
    if threshold is not None:
        drop = torch.lt(
            x, threshold.to(x.dtype)[:, None], out=ws.get("drop", x.shape[0], x.shape[1], x.dtype, x.device)
        )
    scale = 1.0 / (norms[SUM] * temperature)  # pi = e / S; d/dx = d/dz / tau
    kl_term = None  # k (u - E[u]), k = g_KL / (S tau)
    if g_kl is not None:
        k = (g_kl.to(dtype) * scale)[:, None]
        if kept is not None:  # u - E[u] = -(-u + E[u])
            kl_term = kept.neg_u.add_(norms[MEAN_U][:, None]).mul_(-k)
        else:
            kl_term = torch.sub(x.to(dtype), y.to(dtype), out=ws.get("kl", x.shape[0], x.shape[1], dtype, x.device))
            kl_term.sub_(norms[SHIFT][:, None])
            if temperature != 1.0:
                kl_term.div_(temperature)
            kl_term.sub_(norms[MEAN_U][:, None]).mul_(k)
    if kept is not None:
        zc, e = kept.zc, kept.e
    else:
        zc = torch.sub(
            x.to(dtype) if x.dtype != dtype else x,
            norms[MAX][:, None],
            out=out
            if out is not None and out.dtype == dtype
            else ws.get("zc", x.shape[0], x.shape[1], dtype, x.device),
        )
        if temperature != 1.0:
            zc.div_(temperature)
        e = torch.exp(zc, out=ws.like("e", zc)) if g_h is not None else zc.exp_()
        if drop is not None:
            e.addcmul_(e, drop, value=-1.0)
    constant = None if g_lp is None else -(g_lp.to(dtype) * scale)[:, None]  # -a
    if g_h is not None:  # bracket in zc's buffer: -b (zc - E[zc]) - a + k (u - E[u])
        centred = zc.sub_(norms[MEAN_ZC][:, None])
        neg_b = -(g_h.to(dtype) * scale)[:, None]
        bracket = centred.mul_(neg_b) if constant is None else centred.mul_(neg_b).add_(constant)
        if kl_term is not None:
            bracket.add_(kl_term)
        grad = bracket.mul_(e)
    elif kl_term is not None:
        grad = e.mul_(kl_term if constant is None else kl_term.add_(constant))
    elif constant is not None:
        grad = e.mul_(constant)
    else:
        grad = e.zero_()
    if g_lp is not None and rows.targets is not None:
        local, owned = sweep.shard.owned(rows.targets)
        idx = owned.nonzero().squeeze(-1)
        grad[idx, local[idx]] += g_lp[idx].to(dtype) / temperature
    if out is not None and grad.data_ptr() != out.data_ptr():
        out.copy_(grad)
        return out
    return grad


class _VocabParallelStats(torch.autograd.Function):
    """Forward: (logprob of target, entropy, KL to reference) per row; see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        logits,
        reference_logits,
        targets,
        group,
        temperature,
        vocab_size,
        chunk_size,
        inplace_backward,
        entropy,
        truncation,
    ):
        rows, local_vocab = logits.shape
        shard = _shard(local_vocab, group, vocab_size)
        dtype = compute_dtype(logits.dtype)
        out = torch.empty(3, rows, dtype=dtype, device=logits.device)  # logprob, entropy, kl
        norms = torch.empty(5, rows, dtype=dtype, device=logits.device)
        valid = shard.valid
        threshold = support = row_max = None
        if truncation is not None:
            found = find_support(logits[:, :valid], group, truncation, temperature, vocab_size)
            threshold, row_max = found.threshold, found.row_max
            support = torch.zeros(3, rows, dtype=dtype, device=logits.device)
        sweep = Sweep(shard, group, temperature, entropy=entropy)
        reference = reference_logits[:, :valid] if reference_logits is not None else None
        every = Rows(logits[:, :valid], reference, targets, threshold, row_max)
        for lo in range(0, rows, chunk_size):
            hi = min(rows, lo + chunk_size)
            out[:, lo:hi], norms[:, lo:hi] = chunk_forward(
                every[lo:hi], sweep, support=support[:, lo:hi] if support is not None else None
            )
        ctx.save_for_backward(logits, reference_logits, targets, norms, threshold)
        ctx.shard, ctx.temperature, ctx.chunk_size, ctx.dtype = shard, temperature, chunk_size, dtype
        ctx.inplace_backward = inplace_backward
        ctx.set_materialize_grads(False)  # an output nobody differentiates gets no backward work
        if support is None:
            support = torch.zeros(3, 0, dtype=dtype, device=logits.device)
        ctx.mark_non_differentiable(support)
        return out[0], out[1], out[2], support

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_kl, _grad_support):
        logits, reference_logits, targets, norms, threshold = ctx.saved_tensors
        shard, tau, dtype = ctx.shard, ctx.temperature, ctx.dtype
        # In place: each chunk's gradient overwrites that chunk of the logits once it has been read, so
        # backward allocates nothing of full size (as megatron's vocab-parallel cross entropy does).
        grad_logits = logits if ctx.inplace_backward else torch.empty_like(logits)
        if targets is None:
            grad_logprob = None
        if reference_logits is None:
            grad_kl = None
        valid = shard.valid
        if valid < logits.shape[1]:
            grad_logits[:, valid:] = 0
        rows = logits.shape[0]
        sweep = Sweep(shard, None, tau)  # no collective in the gradient
        reference = reference_logits[:, :valid] if grad_kl is not None else None
        every = Rows(logits[:, :valid], reference, targets, threshold)
        grads = (grad_logprob, grad_entropy, grad_kl)
        for lo in range(0, rows if valid else 0, ctx.chunk_size):
            hi = min(rows, lo + ctx.chunk_size)
            chunk_grad(
                every[lo:hi], norms[:, lo:hi], Upstream.of(grads, lo, hi, dtype), sweep, out=grad_logits[lo:hi, :valid]
            )
        return grad_logits, None, None, None, None, None, None, None, None, None


@dataclass
class VocabParallelStats:
    """Per-position outputs of one fused pass; shapes are the logits' leading dims."""

    logprobs: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    # truncated policy only (``truncation``): the support's mass under the full softmax(x / tau), its size,
    # and 1.0 where the target lies outside it (its log-prob is then the extended zc_t - log S_support)
    kept_mass: Optional[torch.Tensor] = None
    support_size: Optional[torch.Tensor] = None
    outside_support: Optional[torch.Tensor] = None
    # log pi at given candidate ids [..., k] (a distillation teacher's top-k: megatron_kl.vocab_parallel.candidates)
    candidate_logprobs: Optional[torch.Tensor] = None
    # under distillation, the exact KL to the reference beside ``kl`` (the teacher's): a second sweep's
    regularizer_kl: Optional[torch.Tensor] = None


def fused_stats(
    logits: torch.Tensor,
    tp_group,
    targets: Optional[torch.Tensor] = None,
    reference_logits: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: int = DEFAULT_CHUNK,
    inplace_backward: bool = False,
    entropy: bool = True,
    truncation: Optional[Truncation] = None,
) -> VocabParallelStats:
    """Token log-prob (if ``targets``), entropy (if ``entropy``) and exact KL to the reference (if
    ``reference_logits``) from one pass over the local logits slice ``[..., V/tp]``, sharing one normaliser.

    Differentiable w.r.t. ``logits`` only. ``targets`` are global token ids. ``vocab_size`` is the true
    vocabulary (padding excluded); default: the whole sharded vocabulary. ``tp_group``: the tensor-parallel
    group (None only in a single-process run). ``inplace_backward=True`` writes the gradient into the
    logits' storage (no full-size allocation in backward): use it only when the logits are a temporary
    that nothing reads after backward, as in the training loss. ``truncation``: the statistics are those of
    the truncated distribution mu = trunc(softmax(logits / temperature)) (top-k / top-p support, found
    exactly over the shards by ``vocab_parallel.truncation.support_threshold``), the KL is KL(mu || softmax(reference /
    temperature)); None or an inactive rule: the full distribution.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    check_group(tp_group)
    if chunk_size is None:  # the Triton kernels need no temporaries: one chunk of every row
        rows = logits.numel() // max(1, logits.shape[-1])
        chunk_size = max(1, rows) if triton_stats.enabled(logits) else block_rows(logits.shape[-1], logits.device)
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
    truncation = effective(truncation, vocab_size or logits.shape[-1] * group_size_rank(tp_group)[0])
    logprob, ent, kl, support = _VocabParallelStats.apply(
        flat, ref, tgt, tp_group, float(temperature), vocab_size, chunk_size, inplace_backward, entropy, truncation
    )
    return VocabParallelStats(
        logprobs=logprob.reshape(lead) if targets is not None else None,
        entropy=ent.reshape(lead) if entropy else None,
        kl=kl.reshape(lead) if reference_logits is not None else None,
        **support_fields(support, lambda value: value.reshape(lead), targets is not None),
    )


def support_fields(support: Optional[torch.Tensor], shaped, has_targets: bool) -> dict:
    """``VocabParallelStats``' support fields from a kernel's ``support [3, n]`` (None or empty: not
    truncated), each row laid out by ``shaped``."""
    if support is None or support.shape[-1] == 0:
        return {}
    return dict(
        kept_mass=shaped(support[0]),
        support_size=shaped(support[1]),
        outside_support=shaped(support[2]) if has_targets else None,
    )


def token_logprobs(
    logits, targets, tp_group, temperature=1.0, vocab_size=None, chunk_size=DEFAULT_CHUNK, truncation=None
):
    """log softmax(logits / temperature)[target] over the full (sharded) vocabulary (or of its truncation)."""
    return fused_stats(
        logits,
        tp_group,
        targets=targets,
        temperature=temperature,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        entropy=False,
        truncation=truncation,
    ).logprobs


def entropy(logits, tp_group, temperature=1.0, vocab_size=None, chunk_size=DEFAULT_CHUNK, truncation=None):
    """-sum_a pi(a) log pi(a) of softmax(logits / temperature) over the full vocabulary (or its truncation)."""
    return fused_stats(
        logits, tp_group, temperature=temperature, vocab_size=vocab_size, chunk_size=chunk_size, truncation=truncation
    ).entropy


def full_kl(
    logits, reference_logits, tp_group, temperature=1.0, vocab_size=None, chunk_size=DEFAULT_CHUNK, truncation=None
):
    """Exact KL(pi_theta || pi_ref) per position (pi_theta truncated with ``truncation``, pi_ref never);
    differentiable w.r.t. ``logits`` only."""
    return fused_stats(
        logits,
        tp_group,
        reference_logits=reference_logits,
        temperature=temperature,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        entropy=False,
        truncation=truncation,
    ).kl
