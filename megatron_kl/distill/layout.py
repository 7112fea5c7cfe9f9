"""A teacher in a layout of its own (``distill.teacher.tensor_parallel`` / ``pipeline_parallel`` other than the
student's).

The teacher runs on every rank with its own TP and pipeline groups (:class:`megatron_kl.models.parallel.OwnLayout`:
world / (TP_t x PP_t) replicas of consecutive ranks, megatron's order inside each; its 1F1B schedule over its own
pipeline group when PP_t > 1). Its rows: the student's data-parallel batches are gathered
into one global batch (student data-parallel rank order) and split over the teacher's replicas; each replica scores
its share; the teacher's log-probs (and final hidden states for the exact KL) come back to every rank, which keeps its
own student data-parallel rank's rows. The student's passes turn those hidden states into the teacher's logits
through :class:`ResharedHead`: the teacher's output weight gathered over its TP group once and cut to the student's
vocabulary partition, so the exact KL's kernels see two logits shards of the same vocabulary columns.

Cost beyond the teacher's forward: one all-gather of the batch's token ids, and one of the teacher's results (its
hidden states, [rows, S, H_teacher] per replica, when the exact KL is used) to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kl.models import builder, output_head, pipeline
from megatron_kl.models.batch import TokenStats
from megatron_kl.models.parallel import OwnLayout, own_layout
from megatron_kl.models.state import ExpertGroups


class ResharedHead:
    """The teacher's output projection in the student's vocabulary partition (``weight`` rows: this student TP rank's
    share of the student's padded vocabulary); the interface of :class:`output_head.ReferenceHead`."""

    regularizer = None  # as output_head.ReferenceHead

    def __init__(self, shard: torch.Tensor):
        self.shard = shard

    def weight(self) -> torch.Tensor:
        return self.shard

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.shard.dtype) @ self.shard.t()


def build_in_own_layout(model, layout, timeout_s: float) -> tuple[OwnLayout, list]:
    """Collective: the frozen teacher's one chunk in its own layout ``layout`` (a ParallelConfig: its tensor and
    pipeline sizes): whole when it has no pipeline of its own, else this rank's stage of it."""
    own = own_layout(layout.tensor_parallel, timeout_s, layout.pipeline_parallel)
    chunk = builder.build_gpt_model(
        model,
        layout,
        pg_collection=own.collection,
        whole=own.pipeline_parallel == 1,
        stage=(own.first_stage, own.last_stage),
    )
    return own, builder.freeze([chunk])


def expert_groups(own: OwnLayout):
    """The routed experts' groups of a model in ``own`` (every expert on every rank, split over its TP group), for
    loading its weights (models.state.ExpertGroups)."""
    return ExpertGroups(ep=own.collection.ep, etp=own.tp)


def reshard_output_weight(
    chunk, own: OwnLayout, vocab_size: int, student_padded_vocab: int, student_tp_group
) -> torch.Tensor:
    """Collective over the teacher's groups: its output weight [V, H_teacher] (padding rows dropped), gathered over its
    TP group on its last pipeline stage and sent down its pipeline, re-padded to the student's padded vocabulary and
    cut to this rank's student TP shard."""
    model = output_head.unwrap(chunk)
    hidden, dtype = model.config.hidden_size, model.config.params_dtype
    device = next(model.parameters()).device
    full = torch.empty((vocab_size, hidden), dtype=dtype, device=device)
    if own.last_stage:
        weight = output_head.output_weight(model).detach().contiguous()
        pieces = [torch.empty_like(weight) for _ in range(own.tensor_parallel)]
        dist.all_gather(pieces, weight, group=own.tp)
        full.copy_(torch.cat(pieces)[:vocab_size])
    if own.pipeline_parallel > 1:  # every stage's ranks score the student's logits too
        dist.broadcast(full, src=dist.get_global_rank(own.pp, own.pipeline_parallel - 1), group=own.pp)
    padded = torch.zeros((student_padded_vocab, full.shape[1]), dtype=full.dtype, device=full.device)
    padded[:vocab_size] = full
    size, rank = dist.get_world_size(student_tp_group), dist.get_rank(student_tp_group)
    rows = student_padded_vocab // size
    return padded[rank * rows : (rank + 1) * rows].contiguous()


def _global_batch(sequences: pipeline.SequenceBatch, dp_rank: int, dp_size: int):
    """Every student data-parallel rank's (tokens, loss_mask), right-padded to the widest and stacked in rank order;
    with the row range of each rank."""
    mine = (dp_rank, sequences.tokens, sequences.loss_mask)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_rank = {}
    for rank, tokens, mask in everyone:
        by_rank.setdefault(rank, (tokens, mask))
    if sorted(by_rank) != list(range(dp_size)):
        raise RuntimeError(f"the teacher's gather saw data-parallel ranks {sorted(by_rank)}, expected 0..{dp_size - 1}")
    width = max(tokens.shape[1] for tokens, _ in by_rank.values())
    tokens = torch.cat(
        [torch.nn.functional.pad(by_rank[r][0], (0, width - by_rank[r][0].shape[1])) for r in range(dp_size)]
    )
    mask = torch.cat(
        [torch.nn.functional.pad(by_rank[r][1], (0, width - by_rank[r][0].shape[1])) for r in range(dp_size)]
    )
    starts = [0]
    for r in range(dp_size):
        starts.append(starts[-1] + by_rank[r][0].shape[0])
    return tokens, mask, starts


def _divisor_at_most(rows: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(rows, limit)) + 1) if rows % d == 0)


def score_in_own_layout(
    chunks: list,
    own: OwnLayout,
    sequences: pipeline.SequenceBatch,
    microbatches: int,
    vocab: pipeline.VocabOptions,
    capture_hidden: bool,
    token_budget: int,
    dp_rank: int,
    dp_size: int,
) -> TokenStats:
    """Collective over every rank: the teacher's stats of this rank's ``sequences`` (module docstring); ``vocab`` as
    the caller gives it (Teacher.score: the full softmax, never truncated)."""
    tokens, mask, starts = _global_batch(sequences, dp_rank, dp_size)
    share = torch.arange(tokens.shape[0]).tensor_split(own.replicas)[own.replica]
    payload = None
    if share.numel():
        batch = pipeline.SequenceBatch(tokens[share], mask[share])
        stats = pipeline.compute_token_stats(
            chunks,
            batch,
            _divisor_at_most(share.numel(), microbatches),
            vocab,
            capture_hidden=capture_hidden,
            token_budget=token_budget,
            own_layout=own,
        )
        if dist.get_rank(own.tp) == 0 and own.last_stage:  # one copy per replica, from where it was computed
            payload = (share, stats.logprobs, stats.entropy, stats.hidden)
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, payload)
    rows, width = tokens.shape
    logprobs, entropy = torch.zeros(rows, width - 1), torch.zeros(rows, width - 1)
    hidden = None
    for result in results:
        if result is None:
            continue
        index, part_logprobs, part_entropy, part_hidden = result
        logprobs[index], entropy[index] = part_logprobs, part_entropy
        if part_hidden is not None:
            if hidden is None:
                hidden = torch.zeros((rows, width, part_hidden.shape[-1]), dtype=part_hidden.dtype)
            hidden[index] = part_hidden
    lo, hi = starts[dp_rank], starts[dp_rank + 1]
    own_width = sequences.tokens.shape[1]
    return TokenStats(
        logprobs=logprobs[lo:hi, : own_width - 1].contiguous(),
        entropy=entropy[lo:hi, : own_width - 1].contiguous(),
        hidden=None if hidden is None else hidden[lo:hi, :own_width].contiguous(),
    )
