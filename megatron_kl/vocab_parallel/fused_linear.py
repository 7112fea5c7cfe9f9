"""Fused linear vocab-parallel log-probs, entropy and exact KL: the output projection inside the chunk loop.

Inputs are the final hidden states ``h [N, H]`` (N rows, the full sequence on every TP rank) and this
rank's vocabulary shard of the output weight ``W [V/tp, H]`` (the embedding when they are tied); for the
KL also the reference's ``h_ref [N, H_ref]`` and ``W_ref [V/tp, H_ref]``. Rows are processed in chunks of
``c``: the raw logits ``z = h_chunk W^T`` and ``r = h_ref_chunk W_ref^T`` exist for one chunk at a time and
are reduced over the TP group exactly as in :mod:`megatron_kl.vocab_parallel.stats` (``chunk_forward``), so
no tensor of size N x V/tp is ever allocated. Backward recomputes each chunk's logits instead of saving
them; with ``G = dL/dz_chunk`` from ``chunk_grad`` (the softmax-weighted bracket over the full, TP-reduced
vocabulary):

    dL/dh_chunk = G W       this rank's vocabulary slice only: a partial sum over the vocabulary, which
                            megatron's copy_to_tensor_model_parallel_region all-reduces over TP (or
                            gather_from_sequence_parallel_region reduce-scatters under sequence
                            parallelism), the collectives of the column-parallel output layer itself
    dL/dW       = sum_chunks G^T h_chunk      the local shard (columns >= vocab_size get exactly 0)

Single pass (``fused_linear_grads``): when the loss is row-separable - L = sum_t l_t(logprob_t, H_t, KL_t),
so dL/d(stats_t) depends on row t's statistics only (PPO-clip, token-level KL in the loss or any KL in the
reward, entropy bonus, fixed aggregation weights) - the caller's ``probe`` gives dL/d(stats) of a chunk's
rows right after its forward, and dL/dh, dL/dW are formed from the chunk logits still in hand: no
recomputation, so the GEMMs are those of the unfused path (z, r, dL/dh, dL/dW).

No gradient reaches the reference. Half-precision inputs: the logit, dL/dh and per-chunk dL/dW products run
in the input dtype with the backend's float32 accumulation (dL/dz rounded to the input dtype first, as in
megatron's own bf16 output layer); logits are upcast to float32 before any exp/log, and dL/dW sums the chunks
in float32. A 16-bit weight wrapped by megatron's DDP gets that float32 dL/dW added straight into its float32
``main_grad`` (megatron's gradient-accumulation fusion; see :func:`weight_grad_for_autograd`). Every chunk temporary lives in a reused workspace buffer. float64 inputs compute in float64. Chunks are processed in a fixed order, so results
are deterministic for a fixed chunk size.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_kl.megatron_compat import apply_cpu_shims
from megatron_kl.vocab_parallel.chunks import Kept, Rows, Sweep, Upstream, Workspace
from megatron_kl.vocab_parallel.groups import group_size_rank
from megatron_kl.vocab_parallel.stats import (
    VocabParallelStats,
    _shard,
    check_group,
    chunk_forward,
    chunk_grad,
    compute_dtype,
    support_fields,
)
from megatron_kl.vocab_parallel.truncation import Truncation, effective, find_support

MIN_CHUNK_ROWS = 64  # below this the per-chunk GEMMs re-read W too often to be efficient
LINEAR_CHUNK_ELEMENTS = 1 << 23  # logits entries per chunk: the GEMMs want more rows than the softmax passes
# GPU: each chunk's GEMMs re-read the whole [V/tp, H] weight, so fewer, larger chunks (2^25 float32 entries = 128
# MiB per chunk logits tensor: 220 rows at V = 152064); not yet tuned on a GPU
LINEAR_CUDA_CHUNK_ELEMENTS = 1 << 25


def linear_chunk_rows(local_vocab: int, single_pass: bool = False, device: Optional[torch.device] = None) -> int:
    """Rows per chunk: one float32 chunk of logits is about LINEAR_CHUNK_ELEMENTS entries, at least 64 rows;
    four times that for the single pass, whose dL/dW accumulation reads and writes the whole [V/tp, H]
    weight gradient once per chunk (measured on 2 CPU cores, 2048 x 152064, H=896: 256 rows at the
    unfused time, 128 rows ~5 % slower; tools/bench_vocab_parallel.py). The softmax passes inside a chunk
    run on cache-sized row blocks (vocab_parallel.chunk_forward), so large chunks cost no extra passes."""
    if device is not None and device.type == "cuda":
        return max(MIN_CHUNK_ROWS, LINEAR_CUDA_CHUNK_ELEMENTS // max(1, local_vocab))
    rows = max(MIN_CHUNK_ROWS, LINEAR_CHUNK_ELEMENTS // max(1, local_vocab))
    return 4 * rows if single_pass else rows


class _FusedLinearStats(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        reference_hidden,
        reference_weight,
        targets,
        group,
        temperature,
        vocab_size,
        chunk_size,
        truncation,
    ):
        rows = hidden.shape[0]
        shard = _shard(weight.shape[0], group, vocab_size)
        dtype = compute_dtype(hidden.dtype)
        has_ref = reference_hidden is not None
        out = torch.empty(3, rows, dtype=dtype, device=hidden.device)  # logprob, entropy, kl
        norms = torch.empty(5, rows, dtype=dtype, device=hidden.device)
        thresholds, support = _support_buffers(truncation, rows, dtype, hidden.device)
        sweep = Sweep(shard, group, temperature, scratch=True)
        ws = sweep.workspace
        for lo in range(0, rows, chunk_size):
            hi = min(rows, lo + chunk_size)
            z = _project(hidden[lo:hi], weight, shard.valid, dtype, ws, "z")
            r = _project(reference_hidden[lo:hi], reference_weight, shard.valid, dtype, ws, "r") if has_ref else None
            tgt = targets[lo:hi] if targets is not None else None
            threshold, row_max = _chunk_support(z, group, truncation, temperature, vocab_size, thresholds, lo, hi)
            out[:, lo:hi], norms[:, lo:hi] = chunk_forward(
                Rows(z, r, tgt, threshold, row_max), sweep, support=support[:, lo:hi] if threshold is not None else None
            )
        ctx.save_for_backward(hidden, weight, reference_hidden, reference_weight, targets, norms, thresholds)
        ctx.shard, ctx.temperature, ctx.chunk_size, ctx.dtype = shard, temperature, chunk_size, dtype
        ctx.weight_param = weight  # the parameter object itself (a saved tensor loses its main_grad attribute)
        ctx.set_materialize_grads(False)  # an output nobody differentiates gets no backward work
        ctx.mark_non_differentiable(support)
        return out[0], out[1], out[2], support

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_kl, _grad_support):
        hidden, weight, reference_hidden, reference_weight, targets, norms, thresholds = ctx.saved_tensors
        shard, tau, dtype = ctx.shard, ctx.temperature, ctx.dtype
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if targets is None:
            grad_logprob = None
        if reference_hidden is None:
            grad_kl = None
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        valid = shard.valid
        grad_weight = _weight_grad_buffer(weight, valid, hidden.shape[0], dtype) if want_weight else None
        rows = hidden.shape[0]
        sweep = Sweep(shard, None, tau)  # no collective in the gradient
        ws = sweep.workspace
        grads = (grad_logprob, grad_entropy, grad_kl)
        for lo in range(0, rows if valid else 0, ctx.chunk_size):  # a padding-only shard has no gradient
            hi = min(rows, lo + ctx.chunk_size)
            z = _project(hidden[lo:hi], weight, valid, dtype, ws, "z")
            r = (
                _project(reference_hidden[lo:hi], reference_weight, valid, dtype, ws, "r")
                if grad_kl is not None
                else None
            )
            chunk = Rows(
                z,
                r,
                targets[lo:hi] if targets is not None else None,
                thresholds[lo:hi] if thresholds is not None else None,
            )
            # dL/dz for this chunk's raw logits [c, valid], compute dtype
            grad = chunk_grad(chunk, norms[:, lo:hi], Upstream.of(grads, lo, hi, dtype), sweep, out=z)
            _accumulate(grad, hidden, weight, lo, hi, valid, grad_hidden, grad_weight, dtype, ws)
        if want_weight:
            grad_weight = weight_grad_for_autograd(ctx.weight_param, grad_weight)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def _support_buffers(truncation, rows: int, dtype, device):
    """(thresholds [rows] or None, support statistics [3, rows], empty when nothing is truncated)."""
    if truncation is None:
        return None, torch.zeros(3, 0, dtype=dtype, device=device)
    return torch.empty(rows, dtype=dtype, device=device), torch.zeros(3, rows, dtype=dtype, device=device)


def _chunk_support(z, group, truncation, temperature, vocab_size, thresholds, lo: int, hi: int):
    """(threshold, row maximum) of a chunk's rows under the truncated support (their logits are whole here;
    the threshold is kept for backward), or (None, None) without truncation."""
    if thresholds is None:
        return None, None
    found = find_support(z, group, truncation, temperature, vocab_size)
    thresholds[lo:hi] = found.threshold
    return thresholds[lo:hi], found.row_max


@torch.no_grad()
def fused_linear_grads(
    hidden,
    weight,
    reference_hidden,
    reference_weight,
    targets,
    group,
    temperature: float,
    vocab_size,
    chunk_size: int,
    probe,
    want_weight: bool = True,
    truncation=None,
    support=None,
):
    """One pass over row chunks of ``hidden [R, H]``: the statistics ``out [3, R]`` (log-prob, entropy, KL),
    ``dL/dh [R, H]`` (this rank's partial sum over its vocabulary slice, before the TP reduction) and
    ``dL/dW [V/tp, H]`` (float32, or None), where ``probe(out, lo, hi) -> (g_lp, g_H, g_KL)`` returns
    dL/d(stats) for rows ``lo:hi`` given ``out[:, :hi]`` (entries None when the loss does not use them).
    Exact only for row-separable losses (module docstring); no autograd graph is built. ``truncation``: the
    truncated policy (``vocab_parallel.fused_stats``); ``support [3, R]`` (given with it) receives the
    support statistics (mass under the full softmax, size, target outside)."""
    rows = hidden.shape[0]
    shard = _shard(weight.shape[0], group, vocab_size)
    dtype = compute_dtype(hidden.dtype)
    has_ref = reference_hidden is not None
    out = torch.zeros(3, rows, dtype=dtype, device=hidden.device)
    norms = torch.empty(5, rows, dtype=dtype, device=hidden.device)
    valid = shard.valid
    grad_hidden = torch.empty_like(hidden) if valid else torch.zeros_like(hidden)  # every row is written
    grad_weight = _weight_grad_buffer(weight, valid, hidden.shape[0], dtype) if want_weight else None
    if truncation is not None and support is None:
        raise ValueError("fused_linear_grads(truncation=...) writes the support statistics into support= [3, R]")
    thresholds = torch.empty(rows, dtype=dtype, device=hidden.device) if truncation is not None else None
    sweep = Sweep(shard, group, temperature, scratch=True)
    ws = sweep.workspace
    for lo in range(0, rows, chunk_size):
        hi = min(rows, lo + chunk_size)
        z = _project(hidden[lo:hi], weight, valid, dtype, ws, "z")
        r = _project(reference_hidden[lo:hi], reference_weight, valid, dtype, ws, "r") if has_ref else None
        tgt = targets[lo:hi] if targets is not None else None
        kept = Kept()  # zc, exp(zc), -u: the gradient reuses the forward's work
        threshold, row_max = _chunk_support(z, group, truncation, temperature, vocab_size, thresholds, lo, hi)
        out[:, lo:hi], norms[:, lo:hi] = chunk_forward(
            Rows(z, r, tgt, threshold, row_max),
            sweep,
            keep=kept,
            support=support[:, lo:hi] if threshold is not None else None,
        )
        g_lp, g_h, g_kl = probe(out, lo, hi)
        if not valid:  # a padding-only shard: its columns get no gradient, its rows a zero partial sum
            continue
        upstream = Upstream(_as(g_lp, dtype), _as(g_h, dtype), _as(g_kl, dtype))
        grad = chunk_grad(Rows(None, targets=tgt), norms[:, lo:hi], upstream, sweep, kept=kept)
        _accumulate(grad, hidden, weight, lo, hi, valid, grad_hidden, grad_weight, dtype, ws)
    return out, grad_hidden, grad_weight


def _accumulate(grad, hidden, weight, lo, hi, valid, grad_hidden, grad_weight, dtype, workspace: Workspace) -> None:
    """dL/dh rows and the in-place dL/dW sum of one chunk from ``grad`` = dL/dz [c, valid] (z = h W^T).
    ``grad_weight`` starts uninitialised (``_weight_grad_buffer``): the first chunk writes it. dL/dh's GEMM runs
    and dL/dW's in the hidden states' dtype (bf16 GEMMs for bf16 models, as megatron's own output layer does);
    dL/dW sums the chunks in float32."""
    low = grad
    if grad.dtype != hidden.dtype:
        low = workspace.get("grad_low", grad.shape[0], grad.shape[1], hidden.dtype, grad.device).copy_(grad)
    if grad_hidden is not None:
        torch.matmul(low, weight[:valid], out=grad_hidden[lo:hi])
    if grad_weight is None:
        return
    if low is grad:  # accumulated in place: no [V/tp, H] temporary per chunk
        grad_weight[:valid].addmm_(grad.t(), hidden[lo:hi].to(dtype), beta=0.0 if lo == 0 else 1.0)
        return
    # 16-bit hidden states: the chunk's product as a 16-bit GEMM (2.3x faster than float32 at 680 x 49152 x 576 on
    # a bf16-capable CPU), summed over chunks in float32 - the precision of megatron's own bf16 weight gradients
    if lo == 0:
        grad_weight[:valid].copy_(_low_weight_product(low, hidden[lo:hi], workspace))
    else:
        grad_weight[:valid].add_(_low_weight_product(low, hidden[lo:hi], workspace))


def _low_weight_product(low_grad, hidden, workspace: Workspace) -> torch.Tensor:
    out = workspace.get("weight_grad_low", low_grad.shape[1], hidden.shape[1], hidden.dtype, hidden.device)
    return torch.mm(low_grad.t(), hidden, out=out)


def _weight_grad_buffer(weight, valid: int, rows: int, dtype) -> torch.Tensor:
    """dL/dW [V/tp, H]: padding rows zero, the valid rows written by the first chunk (no full zero fill)."""
    buffer = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    buffer[valid:] = 0
    return buffer if valid and rows else buffer.zero_()


def _as(grad, dtype):
    return None if grad is None else grad.to(dtype)


class PrecomputedGrad(torch.autograd.Function):
    """``value`` (a detached loss) that back-propagates precomputed ``dL/dh`` and ``dL/dW``, scaled by the
    incoming gradient, into ``hidden`` and ``weight`` (through whatever produced them, e.g. the TP mapping)."""

    @staticmethod
    def forward(ctx, value, hidden, weight, grad_hidden, grad_weight):
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_param = weight
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        weight_grad = None
        if grad_weight is not None and ctx.needs_input_grad[2]:
            weight_grad = weight_grad_for_autograd(ctx.weight_param, grad_weight * grad_output.to(grad_weight.dtype))
        return None, grad_hidden * grad_output.to(grad_hidden.dtype), weight_grad, None, None


def weight_grad_for_autograd(weight: torch.Tensor, grad_weight: torch.Tensor) -> Optional[torch.Tensor]:
    """dL/dW (``grad_weight``, summed in float32) for autograd, in the weight's dtype - or, for a 16-bit weight
    with megatron DDP's float32 ``main_grad`` buffer, added into that buffer here and None for autograd: what
    megatron's gradient-accumulation fusion does in its linear layers. The buffer then receives the float32 sum
    instead of its bf16 rounding, and no [V/tp, H] 16-bit copy or mixed-dtype accumulation is made (135M bf16:
    ~0.1 s per step on 2 CPU cores). A tied embedding's own gradient still reaches the buffer through autograd
    and DDP's hook. float32 weights take the autograd path (their sum is the same either way)."""
    main_grad = getattr(weight, "main_grad", None)
    if (
        weight.dtype in (torch.bfloat16, torch.float16)
        and main_grad is not None
        and main_grad.dtype == grad_weight.dtype
    ):
        main_grad.add_(grad_weight)
        return None
    return grad_weight.to(weight.dtype)


def _project(hidden, weight, valid: int, dtype, workspace: Workspace, name: str) -> torch.Tensor:
    """This rank's valid logit columns of a chunk (not divided by tau) in the compute dtype, in a
    ``workspace`` buffer the caller may overwrite."""
    out = workspace.get(name, hidden.shape[0], valid, dtype, hidden.device)
    if hidden.dtype == dtype:
        return torch.matmul(hidden, weight[:valid].t(), out=out)
    # a bf16/fp16 GEMM (float32 accumulation inside), then upcast: both in reused buffers
    low = workspace.get(name + "_low", hidden.shape[0], valid, hidden.dtype, hidden.device)
    return out.copy_(torch.matmul(hidden, weight[:valid].t(), out=low))


def _gather_rows(hidden: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """The full hidden states on every TP rank, with the backward collective of the output layer."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if tp_group is None or torch.distributed.get_world_size(tp_group) == 1:
        return hidden

    apply_cpu_shims()  # megatron's mappings allocate on torch.cuda.current_device(); a no-op with CUDA
    if sequence_parallel:  # [s/tp, b, H] -> [s, b, H]; backward reduce-scatters the partial dL/dh
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    return copy_to_tensor_model_parallel_region(hidden, group=tp_group)  # backward all-reduces dL/dh


def fused_linear_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tp_group,
    targets: Optional[torch.Tensor] = None,
    reference_hidden: Optional[torch.Tensor] = None,
    reference_weight: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    sequence_parallel: bool = False,
    mask: Optional[torch.Tensor] = None,
    truncation: Optional[Truncation] = None,
) -> VocabParallelStats:
    """Token log-prob (if ``targets``), entropy and exact KL(pi || pi_ref) (if ``reference_hidden``) of
    ``softmax((hidden @ weight^T) / temperature)`` over the TP-sharded vocabulary, without materialising
    the logits. Differentiable w.r.t. ``hidden`` and ``weight``.

    ``hidden [..., H]``: the output layer's input; with ``sequence_parallel`` this rank's sequence shard
    ``[s/tp, ...]`` (gathered along dim 0 here, as megatron's output layer does); ``targets [...]`` and
    ``mask [...]`` then have the full (gathered) leading shape. ``mask``: rows to compute; the others
    output 0 and get no gradient (the same mask on every TP rank). ``vocab_size``: the true vocabulary,
    padding excluded. ``chunk_size``: rows per chunk (default :func:`linear_chunk_rows`). ``truncation``:
    the statistics of the truncated policy (``vocab_parallel.fused_stats``), its support found per chunk.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    check_group(tp_group)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [V/tp, {hidden.shape[-1]}] (hidden size)")
    if (reference_hidden is None) != (reference_weight is None):
        raise ValueError("reference_hidden and reference_weight go together (both or neither)")
    hidden = _gather_rows(hidden, tp_group, sequence_parallel)
    lead = hidden.shape[:-1]
    if reference_hidden is not None:
        with torch.no_grad():
            reference_hidden = _gather_rows(reference_hidden.detach(), tp_group, sequence_parallel)
        if reference_hidden.shape[:-1] != lead or reference_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"reference hidden {tuple(reference_hidden.shape)} / weight {tuple(reference_weight.shape)} do not "
                f"match the policy's {tuple(hidden.shape)} / {tuple(weight.shape)}; policy and reference must "
                "share the TP layout and the token positions"
            )
    if targets is not None and tuple(targets.shape) != tuple(lead):
        raise ValueError(f"targets shape {tuple(targets.shape)} != hidden leading shape {tuple(lead)}")
    if chunk_size is None:
        chunk_size = linear_chunk_rows(weight.shape[0], device=weight.device)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0 (or None for automatic)")
    rows = hidden.reshape(-1, hidden.shape[-1])
    ref_rows = (
        reference_hidden.detach().reshape(-1, reference_hidden.shape[-1]) if reference_hidden is not None else None
    )
    tgt = targets.reshape(-1).long() if targets is not None else None
    index = None
    if mask is not None:
        if tuple(mask.shape) != tuple(lead):
            raise ValueError(f"mask shape {tuple(mask.shape)} != hidden leading shape {tuple(lead)}")
        index = mask.reshape(-1).nonzero().squeeze(-1).to(rows.device)
        rows = rows.index_select(0, index)
        ref_rows = ref_rows.index_select(0, index) if ref_rows is not None else None
        tgt = tgt.index_select(0, index) if tgt is not None else None
    rows = rows.contiguous()
    ref_weight = reference_weight.detach() if reference_weight is not None else None
    truncation = effective(truncation, vocab_size or weight.shape[0] * group_size_rank(tp_group)[0])
    values = _FusedLinearStats.apply(
        rows, weight, ref_rows, ref_weight, tgt, tp_group, float(temperature), vocab_size, chunk_size, truncation
    )

    def shaped(value):
        if index is not None:
            value = value.new_zeros(lead.numel()).index_copy(0, index, value)
        return value.reshape(lead)

    return VocabParallelStats(
        logprobs=shaped(values[0]) if targets is not None else None,
        entropy=shaped(values[1]),
        kl=shaped(values[2]) if reference_hidden is not None else None,
        **support_fields(values[3], shaped, targets is not None),
    )
