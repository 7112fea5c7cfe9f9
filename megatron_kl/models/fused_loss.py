"""The fused path's single pass for row-separable losses: statistics and gradients in one sweep over the
rows, the loss evaluated once on the finished statistics.

For a loss L = sum_t l_t(logprob_t, H_t, KL_t) (``loss_fn.row_separable``), dL/d(stats_t) depends on row t
only, so it can be read off ``loss_fn.probe`` - the same loss, without side effects - evaluated on the
statistics computed so far, as soon as a chunk's rows are done; ``fused_linear_grads`` turns it into dL/dh
and dL/dW while the chunk's logits are still in hand. The loss value and the metrics come from one call of
``loss_fn`` on the complete statistics; :class:`PrecomputedGrad` attaches the gradients to it, and dL/dh
flows back through the output layer's TP collective like any other gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_kl.models.batch import Microbatch
from megatron_kl.models.output_head import fused_layout
from megatron_kl.vocab_parallel.fused_linear import PrecomputedGrad, _gather_rows, fused_linear_grads, linear_chunk_rows
from megatron_kl.vocab_parallel.stats import VocabParallelStats, compute_dtype, support_fields


def single_pass_loss(vocab, reference, mb: Microbatch, hidden, weight, tp_group, sequence_parallel: bool, loss_fn):
    targets, rows, reference_hidden, reference_weight = fused_layout(reference, mb, hidden.device)
    full = _gather_rows(hidden.transpose(0, 1), tp_group, sequence_parallel)  # [s, b, H], TP-aware backward
    s, b = rows.shape
    index = rows.reshape(-1).nonzero().squeeze(-1)
    policy_rows = full.reshape(-1, full.shape[-1]).index_select(0, index)
    has_ref = reference_hidden is not None
    ref_rows = None
    if has_ref:
        with torch.no_grad():
            ref_full = _gather_rows(reference_hidden.detach(), tp_group, sequence_parallel)
        ref_rows = ref_full.reshape(-1, ref_full.shape[-1]).index_select(0, index).contiguous()
        reference_weight = reference_weight.detach()
    flat_targets = targets.reshape(-1).long().index_select(0, index)

    def to_batch(flat: torch.Tensor) -> torch.Tensor:  # computed rows [R] -> [b, s-1]
        full = flat.new_zeros(s * b).index_copy(0, index, flat).reshape(s, b).t()
        return full if mb.labels is not None else full[:, :-1]  # a context-parallel shard keeps every position

    def to_rows(per_token: torch.Tensor, lo: int, hi: int) -> torch.Tensor:  # [b, s-1] -> rows lo:hi
        padded = torch.cat([per_token, per_token.new_zeros(b, 1)], 1).t().reshape(-1)
        return padded.index_select(0, index[lo:hi])

    # the truncated policy's support statistics [3, R] (vocab.truncation is None or truncates: VocabOptions)
    support = None
    if vocab.truncation is not None:
        support = torch.zeros(3, len(index), dtype=compute_dtype(full.dtype), device=full.device)

    def stats_of(out, requires_grad: bool) -> VocabParallelStats:
        values = [to_batch(out[i]).detach().requires_grad_(requires_grad) for i in range(3 if has_ref else 2)]
        return VocabParallelStats(values[0], values[1], values[2] if has_ref else None)

    def probe(out, lo, hi):
        with torch.enable_grad():
            stats = stats_of(out, True)
            leaves = [x for x in (stats.logprobs, stats.entropy, stats.kl) if x is not None]
            grads = torch.autograd.grad(loss_fn.probe(stats, mb), leaves, allow_unused=True)
        grads = [None if g is None else to_rows(g, lo, hi) for g in grads]
        return grads[0], grads[1], grads[2] if has_ref else None

    chunk = vocab.chunk_size or linear_chunk_rows(weight.shape[0], single_pass=True, device=weight.device)
    out, grad_hidden, grad_weight = fused_linear_grads(
        policy_rows.detach().contiguous(),
        weight.detach(),
        ref_rows,
        reference_weight,
        flat_targets,
        tp_group,
        vocab.temperature,
        vocab.vocab_size,
        chunk,
        probe,
        want_weight=weight.requires_grad,
        truncation=vocab.truncation,
        support=support,
    )
    stats = dataclasses.replace(stats_of(out, False), **support_fields(support, to_batch, True))
    loss, metrics = loss_fn(stats, mb)
    return PrecomputedGrad.apply(loss, policy_rows, weight, grad_hidden, grad_weight), metrics
