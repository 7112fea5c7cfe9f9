"""The model side of context parallelism (``parallel.context_parallel``): which layouts run, and a training
microbatch split along the sequence in megatron-core's zigzag order.

megatron-core's context parallelism is Transformer Engine's attention (``TEDotProductAttention`` with the CP
group exchanging keys and values); its RoPE takes each rank's positions from the same zigzag layout
(``get_pos_emb_on_this_cp_rank``), and its DDP averages gradients over the data- x context-parallel ranks. This
module prepares what the model and the loss read on a CP rank:

- inputs: the microbatch's tokens and their positions, padded to a multiple of ``config.sequence_multiple``
  (2 cp, times tp with sequence parallelism), rank r keeping chunks r and 2cp-1-r (``kl.sequence_axis.zigzag_shard``);
- targets: the next token of every input position, ``labels`` (formed on the whole sequence, before the split,
  since a chunk's last target is the next chunk's first token), and the per-target tensors (``loss_mask``,
  log-probs of pi_old / mu / the reference, advantages, ...) padded by one column to the inputs' length and split
  the same way, so a CP rank's statistics [b, 2 L] line up with its loss inputs;
- per-input tensors ([b, S, ...], e.g. the reference's hidden states) are split like the tokens; per-sequence
  ones ([b]) are kept whole.

The loss then runs on the shard with ``kl.sequence_axis.ContextParallelAxis`` (every sequence-level quantity
crosses the group exactly), and per-token statistics that leave the step (pi_old's log-probs, entropies) are
gathered back to [b, S-1] (``gather_positions``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_kl.config import ConfigError, ParallelConfig
from megatron_kl.kl.sequence_axis import LOCAL, ContextParallelAxis, SequenceAxis, zigzag_shard, zigzag_unshard
from megatron_kl.models.batch import Microbatch
from megatron_kl.models.parallel import all_reduce_cpu, collective_device


def check_runnable(parallel: ParallelConfig, have_transformer_engine: bool) -> None:
    """Context parallelism runs only with Transformer Engine's attention (megatron-core's own refuses it)."""
    if parallel.context_parallel > 1 and not have_transformer_engine:
        raise ConfigError(
            f"parallel.context_parallel={parallel.context_parallel} needs Transformer Engine "
            "(megatron-core's context parallelism is TE's attention exchanging keys and values; its "
            "pure-PyTorch attention refuses it): install the `gpu` extra on a GPU machine, or set "
            "parallel.context_parallel=1"
        )


def sequence_axis(group) -> SequenceAxis:
    """The loss side's token axis on this rank: ``LOCAL``, or the zigzag shard of the context-parallel ``group``."""
    if group is None or dist.get_world_size(group) == 1:
        return LOCAL
    return ContextParallelAxis(group)


def shard_microbatch(mb: Microbatch, size: int, rank: int, multiple: int) -> Microbatch:
    """This CP rank's part of a microbatch (module docstring): ``tokens`` / ``position_ids`` [b, 2 L] inputs,
    ``labels`` and every per-target tensor [b, 2 L] (the same positions' next tokens), per-input tensors split
    like the tokens, per-sequence ones whole; ``cp_targets`` = S - 1, the whole microbatch's target count."""
    tokens = mb.tokens
    batch, length = tokens.shape
    padded = -(-length // multiple) * multiple
    labels = torch.cat([tokens[:, 1:], tokens.new_zeros(batch, 1)], dim=1)
    positions = torch.arange(padded, device=tokens.device).unsqueeze(0).expand(batch, padded)  # padding's too

    def split(value, width):
        value = torch.nn.functional.pad(value.movedim(1, -1), (0, padded - width), value=0)
        return zigzag_shard(value, size, rank).movedim(-1, 1).contiguous()

    out = {}
    for key, value in {"tokens": tokens, "loss_mask": mb.loss_mask, **mb.row_tensors()}.items():
        if value.dim() < 2:  # per sequence: whole
            out[key] = value
        elif key == "tokens" or value.shape[1] == length:  # per input position
            out[key] = split(value, length)
        elif value.shape[1] == length - 1:  # per target position: one more (empty) column, then split
            out[key] = split(torch.nn.functional.pad(value.movedim(1, -1), (0, 1)).movedim(-1, 1), length)
        else:
            raise ValueError(
                f"microbatch tensor {key!r} of shape {tuple(value.shape)} is neither per sequence, per "
                f"input position ({length}) nor per target position ({length - 1})"
            )
    return dataclasses.replace(
        mb, **out, labels=split(labels, length), position_ids=split(positions, padded), cp_targets=length - 1
    )


def gather_positions(local: torch.Tensor, group, targets: int) -> torch.Tensor:
    """A per-target tensor's CP shards [b, 2 L, ...] (every rank's) back to [b, ``targets``, ...] in sequence order
    (a collective over ``group``; no gradient)."""
    size = dist.get_world_size(group)
    sent = local.detach().to(collective_device(group)).contiguous()
    parts = [torch.empty_like(sent) for _ in range(size)]
    dist.all_gather(parts, sent, group=group)
    moved = [part.movedim(1, -1) for part in parts]
    return zigzag_unshard(moved, size * local.shape[1])[..., :targets].movedim(-1, 1).to(local.device)


def sum_counts(counts: dict, group) -> dict:
    """Clamp counts of this rank's positions summed over the context-parallel ``group`` (the union of the ranks'
    keys: a per-sequence count is kept by one rank only); unchanged without context parallelism."""
    if group is None or dist.get_world_size(group) == 1:
        return counts

    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, sorted(counts), group=group)
    keys = sorted(set().union(*every))
    totals = all_reduce_cpu(torch.tensor([float(counts.get(key, 0)) for key in keys], dtype=torch.float64), group)
    return {key: float(value) for key, value in zip(keys, totals.tolist())}
