"""The output side of a Megatron GPT chunk: the (vocab-sharded) output projection, a way to get the final hidden
states instead of logits, and the frozen reference's head that turns stored hidden states into logits.

Shared by the pipeline schedule (``pipeline.py``) and the single-pass fused loss (``fused_loss.py``); it imports
neither, so neither imports the other at module level.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from megatron_kl.models.batch import Microbatch


def unwrap(chunk):
    """The GPTModel inside a (possibly DDP-wrapped) model chunk."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def output_weight(model) -> torch.Tensor:
    """The (vocab-sharded) output projection of a last-stage GPTModel: the embedding when tied."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


@contextmanager
def bypass_output_layer(model):
    """Within the block, the model's output layer returns its input: the forward yields the final
    hidden states ``[b, s, H]`` (``[b, s/tp, H]`` under sequence parallelism) instead of logits."""
    layer = model.output_layer
    layer.forward = lambda hidden, weight=None, runtime_gather_output=None: (hidden, None)
    try:
        yield
    finally:
        del layer.forward


class ReferenceHead:
    """The frozen reference's output layer on the last pipeline stage.

    The reference pass keeps its final hidden states ``[B, S, H]`` (``capture_hidden``); the policy
    pass turns a microbatch's slice into vocab-sharded reference logits here, so the exact KL needs
    hidden states (H wide) stored between passes instead of logits (V wide).
    """

    regularizer = None  # a head whose KL is taken beside this one's (WithRegularizer), None: this one's alone

    def __init__(self, reference_chunks: list):
        self.chunk = reference_chunks[-1]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        chunk = self.chunk
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        logits, _ = chunk.output_layer(hidden.transpose(0, 1).contiguous(), weight=weight)
        return logits.transpose(0, 1)

    def weight(self) -> torch.Tensor:
        return output_weight(self.chunk).detach()


class WithRegularizer:
    """The teacher's head with the reference's beside it (distillation with the exact KL to both): ``logits`` /
    ``weight`` are the teacher's (the stats' ``kl``), ``regularizer`` the reference's (the stats' ``regularizer_kl``,
    from ``batch.regularizer_hidden``)."""

    def __init__(self, anchor, regularizer: ReferenceHead):
        self.anchor, self.regularizer = anchor, regularizer

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.anchor.logits(hidden)

    def weight(self) -> torch.Tensor:
        return self.anchor.weight()


def fused_layout(vocab_reference: Optional[ReferenceHead], mb: Microbatch, device):
    """The fused path's row layout, megatron's [s, b] order: targets, the rows to compute (loss-masked
    positions with a target) and the reference's hidden states and output weight (or None). On a context-parallel
    shard (``mb.labels`` set: models/context_parallel) every position has its target."""
    tokens = mb.tokens.to(device)
    b, s = tokens.shape
    if mb.labels is not None:  # a context-parallel shard: every input position's target, split with it
        targets = mb.labels.to(device).t()
        rows = mb.loss_mask.to(device).bool().t()
    else:
        targets = torch.cat([tokens[:, 1:], tokens.new_zeros(b, 1)], dim=1).t()  # [s, b]; last row has no target
        rows = torch.cat([mb.loss_mask.to(device).bool(), torch.zeros(b, 1, dtype=torch.bool, device=device)], 1).t()
    reference_hidden = reference_weight = None
    if vocab_reference is not None and mb.reference_hidden is not None:
        reference_hidden = mb.reference_hidden.to(device).transpose(0, 1)
        reference_weight = vocab_reference.weight()
    return targets, rows.contiguous(), reference_hidden, reference_weight
