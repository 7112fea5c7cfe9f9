"""Per-token quantities of given sequences through Megatron's pipeline schedules.

A batch is ``tokens [B, S]`` (prompt + response, right-padded) and ``loss_mask [B, S-1]`` aligned with the
targets ``tokens[:, 1:]``: position t of every per-token output refers to predicting ``tokens[:, t+1]``
from ``tokens[:, :t+1]``. Logits stay vocab-sharded: the last stage turns them into log-probs and
entropies with :mod:`megatron_kl.vocab_parallel.stats` (temperature applied as the rollout engine does), or,
on the fused path (``VocabOptions.fused``), the output layer is bypassed and
:mod:`megatron_kl.vocab_parallel.fused_linear` computes the same quantities from the final hidden states and the
output weight shard without ever materialising the logits (only the loss-masked rows are computed).

``run_schedule`` is the one entry point, forward-only or forward+backward, with any TP/PP/VPP layout.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_kl.config import sequence_multiple
from megatron_kl.models import context_parallel, routing_replay
from megatron_kl.models.batch import SUPPORT_KEYS, Microbatch, MicrobatchStats, SequenceBatch, TokenStats  # noqa: F401
from megatron_kl.models.fused_loss import single_pass_loss
from megatron_kl.models.output_head import ReferenceHead, bypass_output_layer, fused_layout, output_weight, unwrap
from megatron_kl.models.parallel import collective_device
from megatron_kl.vocab_parallel.candidates import candidate_logits, candidate_logprobs, fused_candidate_logits
from megatron_kl.vocab_parallel.fused_linear import _gather_rows, fused_linear_stats, linear_chunk_rows
from megatron_kl.vocab_parallel.stats import DEFAULT_CHUNK, VocabParallelStats, full_kl, fused_stats
from megatron_kl.vocab_parallel.truncation import Truncation, effective

# loss_fn(stats, microbatch) -> (loss, metrics). `loss` is this microbatch's share of the global loss
# (already divided by the global normaliser), so the microbatch shares add up to the batch loss.
# The Microbatch (models/batch.py) carries its rows of the batch's tensors (cut to its columns) and, on the unfused
# path, the local logits slice (``logits``). On the fused path the stats are 0 outside loss_mask (those rows are not
# computed).
LossFn = Callable[[VocabParallelStats, Microbatch], tuple[torch.Tensor, dict]]


# "auto" on a training microbatch whose gradient needs recomputed logits in backward (not row-separable, or
# model.fused_grad=recompute): fused when the logits the unfused path would hold (policy + reference, rows x
# V/tp) exceed the fused path's chunk working set by this factor; below it the fused chunk buffers cost more
# memory than the logits themselves (measured: tools/bench_vocab_parallel.py --section linear; README)
FUSED_MIN_LOGITS_PER_CHUNK = 4


@dataclass
class VocabOptions:
    vocab_size: int  # the true vocabulary (Megatron pads the output layer beyond it)
    temperature: float = 1.0
    chunk_size: int = DEFAULT_CHUNK  # rows per chunk; None: automatic (per path)
    fused: Optional[bool] = False  # fused linear path: never materialise the logits; None: by size (auto)
    grad_in_forward: bool = False  # fused + row-separable loss: gradients formed in the forward pass
    # the policy's statistics are those of the truncated sampling distribution (rollout.sampling.distribution);
    # None: the full softmax (the reference's passes always use None); a rule that truncates nothing becomes None
    truncation: Optional[Truncation] = None

    def __post_init__(self):
        self.truncation = effective(self.truncation, self.vocab_size)

    def use_fused(self, rows: int, local_vocab: int, single_sweep: bool = False) -> bool:
        """The path for a microbatch of ``rows`` token positions over ``local_vocab`` columns: as configured,
        or (auto):

        - ``single_sweep`` (a forward-only pass, or training with the single-pass gradient): fused from one
          full chunk of rows up. The fused sweep does the unfused path's GEMMs and softmax passes on
          cache-sized blocks and skips the [rows, V/tp] tensors (their allocation, transposes and, in
          training, the logits gradient). Measured in the trainer (tools/bench_trl.py workload, 1824 rows x
          49152, 2 CPU cores): reference/old-log-prob passes 0.45 -> 0.13 s at hidden 128; the update
          2.16 -> 0.53 s at hidden 128 and 13.2 -> 10.3 s at the 135M shape; peak RSS lower.
        - training with recomputation in backward: fused when the unfused logits would exceed
          FUSED_MIN_LOGITS_PER_CHUNK single-pass chunks (memory rule above; the recomputed projection costs
          GEMMs: 2.1x the unfused kernel time at hidden 896 x 152064)."""
        if self.fused is not None:
            return self.fused
        if single_sweep:
            return rows >= (self.chunk_size or linear_chunk_rows(local_vocab))
        chunk_rows = self.chunk_size or linear_chunk_rows(local_vocab, single_pass=self.grad_in_forward)
        return rows >= FUSED_MIN_LOGITS_PER_CHUNK * chunk_rows

    @classmethod
    def for_model(
        cls, model_cfg, parallel_cfg, temperature: float = 1.0, truncation: Optional[Truncation] = None
    ) -> "VocabOptions":
        """Options from ``model.logprob_path`` (auto | fused | unfused), ``model.fused_grad`` (auto |
        in_forward | recompute) and ``model.logprob_chunk_rows``; ``truncation``: the trained distribution's
        support rule (``SamplingConfig.trained_truncation``)."""
        fused = {"fused": True, "unfused": False, "auto": None}[model_cfg.logprob_path]
        return cls(
            vocab_size=model_cfg.vocab_size,
            temperature=temperature,
            chunk_size=model_cfg.logprob_chunk_rows,
            fused=fused,
            grad_in_forward=model_cfg.fused_grad != "recompute",
            truncation=truncation,
        )


def _unfused_stats(vocab: VocabOptions, reference: Optional[ReferenceHead], mb: Microbatch, logits, tp_group):
    last = None if mb.labels is not None else -1  # a context-parallel shard: every position has its target
    targets = mb.labels if mb.labels is not None else mb.tokens[:, 1:]
    reference_logits = None
    if reference is not None and mb.reference_hidden is not None:
        reference_logits = reference.logits(mb.reference_hidden.to(logits.device))[:, :last]
    stats = fused_stats(
        logits[:, :last],
        tp_group,
        targets=targets.to(logits.device),
        reference_logits=reference_logits,
        temperature=vocab.temperature,
        vocab_size=vocab.vocab_size,
        chunk_size=vocab.chunk_size,
        truncation=vocab.truncation,
    )
    if _has_regularizer(reference, mb):  # the exact KL to the reference beside the teacher's: a second sweep
        regularizer_logits = reference.regularizer.logits(mb.regularizer_hidden.to(logits.device))[:, :last]
        stats = dataclasses.replace(
            stats,
            regularizer_kl=full_kl(
                logits[:, :last],
                regularizer_logits,
                tp_group,
                vocab.temperature,
                vocab.vocab_size,
                vocab.chunk_size,
                vocab.truncation,
            ),
        )
    if mb.teacher_top_ids is None:
        return stats
    ids = _with_targets(mb, targets, logits.device)
    picked = candidate_logits(logits[:, :last], ids, tp_group, vocab.vocab_size)
    return dataclasses.replace(
        stats,
        candidate_logprobs=candidate_logprobs(stats.logprobs, picked[..., :-1], picked[..., -1], vocab.temperature),
    )


def _has_regularizer(reference, mb: Microbatch) -> bool:
    """Whether this pass takes the exact KL to the reference beside the teacher's (output_head.WithRegularizer)."""
    return reference is not None and reference.regularizer is not None and mb.regularizer_hidden is not None


def _with_targets(mb: Microbatch, targets: torch.Tensor, device) -> torch.Tensor:
    """The teacher's top-k ids [b, s-1, k] with each position's sampled token appended as id k + 1."""
    return torch.cat([mb.teacher_top_ids.to(device), targets.to(device)[..., None]], -1)


def _fused_candidates(
    vocab: VocabOptions, mb: Microbatch, stats: VocabParallelStats, hidden, weight, tp_group, sequence_parallel: bool
) -> VocabParallelStats:
    """``stats`` with log pi at the microbatch's ``teacher_top_ids`` from the hidden states ``[b, s(/tp), H]`` and
    the weight shard (megatron_kl.vocab_parallel.candidates: k logits per position, never the vocabulary's)."""
    # megatron's [s, b] order, so the gradient reaching the TP collective is contiguous (its all-reduce runs on
    # .contiguous(): a transposed gradient would be reduced in a copy and the result lost)
    full = _gather_rows(hidden.transpose(0, 1), tp_group, sequence_parallel)  # [s, b, H]
    ids = _with_targets(mb, mb.tokens[:, 1:], hidden.device).transpose(0, 1)  # [s-1, b, k+1]
    picked = fused_candidate_logits(full[:-1], weight, ids, tp_group, vocab.vocab_size).transpose(0, 1)
    return dataclasses.replace(
        stats,
        candidate_logprobs=candidate_logprobs(stats.logprobs, picked[..., :-1], picked[..., -1], vocab.temperature),
    )


def _fused_stats(
    vocab: VocabOptions,
    reference: Optional[ReferenceHead],
    mb: Microbatch,
    hidden,
    weight,
    tp_group,
    sequence_parallel: bool,
) -> VocabParallelStats:
    """Stats ``[b, s-1]`` from the hidden states ``[b, s(/tp), H]``, computed in megatron's [s, b] order."""
    targets, rows, reference_hidden, reference_weight = fused_layout(reference, mb, hidden.device)
    stats = fused_linear_stats(
        hidden.transpose(0, 1),
        weight,
        tp_group,
        targets=targets,
        reference_hidden=reference_hidden,
        reference_weight=reference_weight,
        temperature=vocab.temperature,
        vocab_size=vocab.vocab_size,
        chunk_size=vocab.chunk_size,
        sequence_parallel=sequence_parallel,
        mask=rows,
        truncation=vocab.truncation,
    )

    last = None if mb.labels is not None else -1  # a context-parallel shard keeps every position

    def per_sequence(value):
        return None if value is None else value.t()[:, :last]

    stats = VocabParallelStats(*(per_sequence(getattr(stats, f.name)) for f in dataclasses.fields(stats)))
    if _has_regularizer(reference, mb):  # the exact KL to the reference beside the teacher's: a second sweep
        regularizer = fused_linear_stats(
            hidden.transpose(0, 1),
            weight,
            tp_group,
            reference_hidden=mb.regularizer_hidden.to(hidden.device).transpose(0, 1),
            reference_weight=reference.regularizer.weight(),
            temperature=vocab.temperature,
            vocab_size=vocab.vocab_size,
            chunk_size=vocab.chunk_size,
            sequence_parallel=sequence_parallel,
            mask=rows,
            truncation=vocab.truncation,
        )
        stats = dataclasses.replace(stats, regularizer_kl=per_sequence(regularizer.kl))
    if mb.teacher_top_ids is None:
        return stats
    return _fused_candidates(vocab, mb, stats, hidden, weight, tp_group, sequence_parallel)


def _forward_step(
    vocab: VocabOptions,
    loss_fn: LossFn,
    num_microbatches: int,
    forward_only: bool,
    reference: Optional[ReferenceHead],
    own_tp_group,
    data_iterator,
    model,
):
    from megatron.core import parallel_state

    device = next(model.parameters()).device
    mb = next(data_iterator).to(device)
    inner = unwrap(model)
    cp_group = context_parallel_group() if own_tp_group is None else None
    if cp_group is not None:  # this rank's zigzag shard of every sequence
        config = inner.config
        multiple = sequence_multiple(
            config.context_parallel_size, config.tensor_model_parallel_size, config.sequence_parallel
        )
        mb = context_parallel.shard_microbatch(mb, dist.get_world_size(cp_group), dist.get_rank(cp_group), multiple)
        tokens, position_ids = mb.tokens, mb.position_ids
    else:
        tokens = mb.tokens
        position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    single_pass = (
        vocab.grad_in_forward
        and getattr(loss_fn, "row_separable", False)
        and not forward_only
        and mb.teacher_top_ids is None  # the single pass probes log-probs, entropy and one KL only
        and not _has_regularizer(reference, mb)
    )
    fused = inner.post_process and vocab.use_fused(
        tokens.numel(), output_weight(inner).shape[0], single_sweep=forward_only or single_pass
    )
    tp_group = parallel_state.get_tensor_model_parallel_group() if own_tp_group is None else own_tp_group
    if mb.routed_experts is not None:  # mixture of experts: the rollout's expert ids for this microbatch's routers
        routing_replay.load_microbatch(
            inner,
            mb.routed_experts,
            inner.config.sequence_parallel,
            dist.get_rank(tp_group),
            dist.get_world_size(tp_group),
        )
    with bypass_output_layer(inner) if fused else nullcontext():
        output = model(tokens, position_ids, None)

    def loss_func(output):
        if fused and single_pass and torch.is_grad_enabled():
            loss, metrics = single_pass_loss(
                vocab,
                reference,
                mb,
                output,
                output_weight(inner),
                tp_group,
                inner.output_layer.sequence_parallel,
                loss_fn,
            )
        elif fused:
            stats = _fused_stats(
                vocab, reference, mb, output, output_weight(inner), tp_group, inner.output_layer.sequence_parallel
            )
            loss, metrics = loss_fn(stats, mb)
        else:
            stats = _unfused_stats(vocab, reference, mb, output, tp_group)
            loss, metrics = loss_fn(stats, dataclasses.replace(mb, logits=output))
        # The schedule divides a 2-tuple loss by num_microbatches; undo it so shares add up exactly.
        return loss * num_microbatches, metrics

    return output, loss_func


def _setup_config(chunks, finalize: bool):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = finalize_model_grads if finalize else None
    if finalize and hasattr(chunks[0], "no_sync"):
        no_sync = [c.no_sync for c in chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return config


def run_schedule(
    chunks: list,
    batch: SequenceBatch,
    num_microbatches: int,
    loss_fn: LossFn,
    vocab: VocabOptions,
    forward_only: bool,
    reference: Optional[ReferenceHead] = None,
    token_budget: int = 0,
    own_layout=None,
) -> list[dict]:
    """Run the pipeline schedule over ``batch`` split by :meth:`SequenceBatch.split` (``num_microbatches``
    slices, or microbatches of at most ``token_budget`` padded tokens); returns the per-microbatch metrics
    dicts (on the last pipeline stage; an empty list elsewhere). With ``reference`` and a
    ``batch.reference_hidden``, the stats carry the exact per-position KL(pi || pi_ref).

    ``own_layout`` (:class:`megatron_kl.models.parallel.OwnLayout`): ``chunks`` is a model built in a layout of its own
    (a distillation teacher), without context parallelism: forward only, through megatron's non-pipelined schedule,
    or its 1F1B schedule over the layout's pipeline group, with that layout's process groups."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    if own_layout is not None and (not forward_only or len(chunks) != 1):
        raise ValueError("a model in its own layout runs forward only, as one chunk")
    microbatches = batch.split(num_microbatches, token_budget)
    config = _setup_config(chunks, finalize=not forward_only)
    config.variable_seq_lengths = token_budget > 0  # pipeline stages exchange each microbatch's shape
    data = [iter(microbatches) for _ in chunks]
    if own_layout is None:
        forward_backward = get_forward_backward_func()
    elif own_layout.pipeline_parallel == 1:
        forward_backward = partial(forward_backward_no_pipelining, pg_collection=own_layout.collection)
    else:  # megatron's 1F1B schedule over the layout's own pipeline group
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

        forward_backward = partial(
            forward_backward_pipelining_without_interleaving,
            pg_collection=own_layout.collection,
            p2p_communicator=P2PCommunicator(pp_group=own_layout.pp, config=config),
        )
    own_tp_group = None if own_layout is None else own_layout.tp
    try:
        return forward_backward(
            forward_step_func=partial(
                _forward_step, vocab, loss_fn, len(microbatches), forward_only, reference, own_tp_group
            ),
            data_iterator=data if len(chunks) > 1 else data[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(microbatches),
            seq_length=batch.tokens.shape[1],
            micro_batch_size=microbatches[0].tokens.shape[0],
            forward_only=forward_only,
        )
    finally:
        if batch.routed_experts is not None:
            routing_replay.clear([unwrap(chunk) for chunk in chunks])


def context_parallel_group():
    """megatron's context-parallel group when it has more than one rank, else None."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def broadcast_from_last_stage(tensor: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
    """Give every pipeline rank the last stage's tensor."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return tensor
    device = collective_device(group)
    tensor = torch.empty(shape, dtype=dtype, device=device) if tensor is None else tensor.to(device).contiguous()
    dist.broadcast(tensor, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return tensor.cpu()


def masked_token_stats(stats: VocabParallelStats, mb: Microbatch, keys) -> MicrobatchStats:
    """One microbatch's per-token ``keys`` of ``stats`` (:meth:`TokenStats.keys`: log-probs and entropy always),
    zero at masked positions, with its ``rows``; on a context-parallel shard gathered back to the whole sequences
    [b, S-1]."""
    mask = mb.loss_mask.to(stats.logprobs.dtype)
    out = {
        key: (value := getattr(stats, key)) * (mask if value.dim() == mask.dim() else mask[..., None]) for key in keys
    }
    if mb.cp_targets is not None:
        group = context_parallel_group()
        out = {key: context_parallel.gather_positions(value, group, mb.cp_targets) for key, value in out.items()}
    return MicrobatchStats(mb.rows, TokenStats(**out))


def scatter_rows(
    parts: list[torch.Tensor], rows: list[torch.Tensor], shape, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One CPU ``shape`` tensor (``dtype``) from microbatch pieces ``[b, w, ...]`` placed at their ``rows`` and
    first ``w`` columns (zero beyond a piece's columns)."""
    full = torch.zeros(shape, dtype=dtype)
    for part, index in zip(parts, rows):
        full[index, : part.shape[1]] = part.detach().to("cpu", dtype)
    return full


def assemble_token_stats(
    parts: list[MicrobatchStats], keys, shape, broadcast: bool = True, candidates: int = 0
) -> TokenStats:
    """The batch's ``[B, S-1]`` float32 stats from its microbatches' :func:`masked_token_stats` (on the last
    pipeline stage; empty elsewhere), on every pipeline rank (``broadcast``; without, where they were computed);
    ``candidate_logprobs`` ``[B, S-1, candidates]``."""
    result = {}
    for key in keys:
        size = (*shape, candidates) if key == "candidate_logprobs" else tuple(shape)
        full = scatter_rows([getattr(p.stats, key) for p in parts], [p.rows for p in parts], size) if parts else None
        result[key] = broadcast_from_last_stage(full, size, torch.float32) if broadcast else full
    return TokenStats(**result)


@torch.no_grad()
def compute_token_stats(
    chunks: list,
    batch: SequenceBatch,
    num_microbatches: int,
    vocab: VocabOptions,
    reference: Optional[ReferenceHead] = None,
    capture_hidden: bool = False,
    token_budget: int = 0,
    own_layout=None,
) -> TokenStats:
    """Forward-only per-token statistics of ``batch`` (:class:`TokenStats`), on every rank.

    Works for the policy and for the frozen reference alike. With ``reference`` (and
    ``batch.reference_hidden``) also the exact KL; with ``capture_hidden`` also the final hidden states
    (last pipeline stage only; None elsewhere); with ``vocab.truncation`` the support statistics. ``own_layout``: a
    model in a tensor-parallel layout of its own (:func:`run_schedule`).
    """
    for chunk in chunks:
        chunk.eval()
    candidates = 0 if batch.teacher_top_ids is None else batch.teacher_top_ids.shape[-1]
    # decided alike on every pipeline stage (the hidden states the KLs read are on the last one only)
    regularizer = reference is not None and reference.regularizer is not None
    keys = TokenStats.keys(reference is not None, vocab.truncation is not None, candidates > 0, regularizer)
    captured: list[torch.Tensor] = []
    hook = None
    if capture_hidden and getattr(chunks[-1], "post_process", False):
        hook = chunks[-1].output_layer.register_forward_hook(
            lambda module, args, output: captured.append(args[0].detach().transpose(0, 1).cpu())
        )

    def collect(stats: VocabParallelStats, mb: Microbatch):
        return torch.zeros((), dtype=stats.logprobs.dtype), masked_token_stats(stats, mb, keys)

    try:
        outputs = run_schedule(
            chunks,
            batch,
            num_microbatches,
            collect,
            vocab,
            forward_only=True,
            reference=reference,
            token_budget=token_budget,
            own_layout=own_layout,
        )
    finally:
        if hook is not None:
            hook.remove()
    result = assemble_token_stats(
        outputs, keys, tuple(batch.loss_mask.shape), broadcast=own_layout is None, candidates=candidates
    )
    if capture_hidden:
        hidden = None
        cp_group = context_parallel_group() if own_layout is None else None
        if captured and cp_group is not None:  # each rank's zigzag shard of the hidden states, gathered back
            captured = [
                context_parallel.gather_positions(h, cp_group, o.stats.logprobs.shape[1] + 1)
                for h, o in zip(captured, outputs)
            ]
        if captured:  # both in schedule order: each forward's hidden states, then its collect()
            rows = [o.rows for o in outputs]
            hidden = scatter_rows(captured, rows, (*batch.tokens.shape, captured[0].shape[-1]), captured[0].dtype)
        result = dataclasses.replace(result, hidden=hidden)
    return result
