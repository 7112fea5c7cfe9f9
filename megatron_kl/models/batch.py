"""The batch the trainer's model passes run over, its microbatches, and the per-token statistics a pass returns:
named tensors, not string-keyed dicts.

A :class:`SequenceBatch` is right-padded sequences plus the tensors that travel with their rows - what the
rollout produced and the scoring passes added - each with its shape stated below; a misspelt name is an
``AttributeError`` where it is written (the classes have slots), not a ``KeyError`` on some rank later. The
schedule cuts it into :class:`Microbatch` es (rows, and with a token budget the columns up to the microbatch's
longest row); context parallelism cuts a microbatch into this rank's zigzag shard
(:func:`megatron_kl.models.context_parallel.shard_microbatch`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

# the tensors that travel with the rows, in the order they are listed on SequenceBatch
ROW_TENSORS = (
    "behavior_logprobs",
    "reference_logprobs",
    "advantages",
    "old_logprobs",
    "kl_returns",
    "routed_experts",
    "reference_hidden",
    "teacher_logprobs",
    "distill_returns",
    "teacher_top_ids",
    "teacher_top_logprobs",
    "regularizer_hidden",
)


@dataclass(slots=True)
class SequenceBatch:
    """Right-padded sequences, B rows of S tokens, and the tensors split with their rows.

    - ``tokens [B, S]`` int64; ``loss_mask [B, S-1]``: 1 where ``tokens[:, t+1]`` is a response token;
    - per target position ``[B, S-1]`` (aligned with ``loss_mask``), the policy loss's inputs
      (:class:`megatron_kl.algo.losses.LossInputs`): ``behavior_logprobs`` log mu, ``reference_logprobs`` log pi_ref,
      ``advantages``, ``old_logprobs`` log pi_old, ``kl_returns`` the credited KL penalty of the reward placement;
      under distillation ``teacher_logprobs`` log pi_teacher and ``distill_returns`` the distillation term's penalty;
    - per target position and candidate ``[B, S-1, k]`` (distillation with the top-k approximation): the teacher's k
      most likely token ids ``teacher_top_ids`` (int64) and their log-probs ``teacher_top_logprobs``; a pass over a
      batch carrying the ids also returns the model's log-probs at them (``TokenStats.candidate_logprobs``);
    - per input position: ``routed_experts [B, S, layers, k]`` the rollout engine's expert ids (routing replay),
      ``reference_hidden [B, S, H']`` the final hidden states of the model the exact KL is taken to on the fused path
      (the reference's; under distillation the teacher's, H' its width), and under distillation with the exact KL to
      the reference too, ``regularizer_hidden [B, S, H]`` the reference's;

    None: not carried.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logprobs: Optional[torch.Tensor] = None
    reference_logprobs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    kl_returns: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    reference_hidden: Optional[torch.Tensor] = None
    teacher_logprobs: Optional[torch.Tensor] = None
    distill_returns: Optional[torch.Tensor] = None
    teacher_top_ids: Optional[torch.Tensor] = None
    teacher_top_logprobs: Optional[torch.Tensor] = None
    regularizer_hidden: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(self.tokens.shape)}")
        expected = (self.tokens.shape[0], self.tokens.shape[1] - 1)
        if tuple(self.loss_mask.shape) != expected:
            raise ValueError(
                f"loss_mask must be {expected} (aligned with tokens[:, 1:]), got {tuple(self.loss_mask.shape)}"
            )

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """The carried tensors (name -> tensor), those left None out."""
        return {name: value for name in ROW_TENSORS if (value := getattr(self, name)) is not None}

    def lengths(self) -> torch.Tensor:
        """[B] tokens each row needs: through its last response token (at least 2; a row without response
        tokens has nothing to score)."""
        width = self.loss_mask.shape[1]
        last = torch.where(self.loss_mask.bool(), torch.arange(width), -1).amax(-1)
        return (last + 2).clamp_min(2)

    def split(self, num_microbatches: int, token_budget: int = 0) -> list["Microbatch"]:
        """Microbatches: ``num_microbatches`` equal slices of rows (``token_budget`` 0), or, with a budget,
        rows sorted by :meth:`lengths` (longest first) packed greedily into microbatches of at most
        ``token_budget`` padded tokens (rows x the microbatch's longest row), each cut to its own longest
        row; a row longer than the budget is a microbatch of its own."""
        if token_budget > 0:
            return [self._cut(rows, n, width) for n, (rows, width) in enumerate(self.token_groups(token_budget))]
        batch = self.tokens.shape[0]
        if batch % num_microbatches:
            raise ValueError(f"batch size {batch} is not divisible by num_microbatches={num_microbatches}")
        size = batch // num_microbatches
        return [self._cut(torch.arange(i, i + size), n) for n, i in enumerate(range(0, batch, size))]

    def token_groups(self, token_budget: int) -> list[tuple[torch.Tensor, int]]:
        """The budgeted split's (rows, width) per microbatch, without cutting any tensor: rows sorted by
        :meth:`lengths` (longest first, ties by row) packed greedily while rows x the first row's length
        <= ``token_budget``."""
        lengths = self.lengths().tolist()
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        groups: list[list[int]] = []
        for i in order:
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
                groups[-1].append(i)
            else:
                groups.append([i])
        return [(torch.tensor(group), lengths[group[0]]) for group in groups]

    def _cut(self, rows: torch.Tensor, index: int, width: Optional[int] = None) -> "Microbatch":
        """Microbatch ``index``: rows ``rows`` (contiguous slices stay views), the first ``width`` tokens."""
        contiguous = width is None and rows.numel() > 0 and bool((rows[1:] - rows[:-1] == 1).all())
        pick = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows
        seq = self.tokens.shape[1]

        def cut(value: torch.Tensor) -> torch.Tensor:
            if width is not None and value.dim() >= 2 and value.shape[1] in (seq, seq - 1):
                value = value[:, : width if value.shape[1] == seq else width - 1]
            return value[pick]

        return Microbatch(
            tokens=cut(self.tokens),
            loss_mask=cut(self.loss_mask),
            index=index,
            rows=rows,
            **{name: cut(value) for name, value in self.row_tensors().items()},
        )

    def select(self, index: torch.Tensor) -> "SequenceBatch":
        """The rows ``index`` (a minibatch), every carried tensor with them."""
        return SequenceBatch(
            self.tokens[index],
            self.loss_mask[index],
            **{name: value[index] for name, value in self.row_tensors().items()},
        )


@dataclass(slots=True)
class Microbatch(SequenceBatch):
    """One microbatch of a :class:`SequenceBatch`: its ``index`` (ordinal) and ``rows`` of the batch; on a
    context-parallel rank this rank's shard (``labels`` [b, 2L] the next token of every kept input position,
    ``position_ids``, ``cp_targets`` = S - 1 of the whole microbatch; per-target tensors are then [b, 2L] too); on
    the unfused path the loss function is also handed the local ``logits`` slice."""

    index: int = 0
    rows: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    cp_targets: Optional[int] = None
    logits: Optional[torch.Tensor] = None

    def __post_init__(self):  # a context-parallel shard's loss_mask is as wide as its tokens
        pass

    def to(self, device) -> "Microbatch":
        """Every tensor but ``rows`` (bookkeeping, on the CPU) on ``device``."""
        moved = {
            f.name: value.to(device)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor) and f.name != "rows"
        }
        return dataclasses.replace(self, **moved)


SUPPORT_KEYS = ("kept_mass", "support_size", "outside_support")  # the truncated policy's support statistics


@dataclass(frozen=True)
class TokenStats:
    """A batch's per-token statistics of one model, each ``[B, S-1]`` float32 on the CPU, aligned with
    ``loss_mask`` (position t scores token t + 1) and 0 at masked positions, on every pipeline rank.

    - ``logprobs``: log pi(y_{t+1} | y_<=t) of the (tempered; with truncation, truncated) distribution;
    - ``entropy``: H(pi(. | y_<=t));
    - ``kl``: the exact KL(pi || pi_ref) at the position over the whole vocabulary (with a reference head);
    - ``kept_mass``, ``support_size``, ``outside_support``: the truncated policy's support (with truncation);
    - ``hidden``: ``[B, S, H]`` final hidden states feeding the output layer, in the model's dtype (when captured;
      None off the last pipeline stage);
    - ``candidate_logprobs``: ``[B, S-1, k]`` log pi at the batch's ``teacher_top_ids`` (when it carries them);
    - ``regularizer_kl``: under distillation, the exact KL(pi || pi_ref) to the reference beside ``kl`` (the teacher's).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    kl: Optional[torch.Tensor] = None
    kept_mass: Optional[torch.Tensor] = None
    support_size: Optional[torch.Tensor] = None
    outside_support: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    candidate_logprobs: Optional[torch.Tensor] = None
    regularizer_kl: Optional[torch.Tensor] = None

    @property
    def truncated(self) -> bool:
        """Whether the support statistics are present (the policy's distribution is truncated)."""
        return self.kept_mass is not None

    def placed(self, order: torch.Tensor) -> "TokenStats":
        """The statistics of rows computed in the order ``order`` put back in batch order (row i -> row order[i])."""
        return dataclasses.replace(
            self,
            **{
                f.name: torch.empty_like(value).index_copy_(0, order, value)
                for f in dataclasses.fields(self)
                if (value := getattr(self, f.name)) is not None
            },
        )

    @classmethod
    def keys(cls, exact_kl: bool, truncated: bool, candidates: bool = False, regularizer: bool = False) -> tuple:
        """The per-token fields a pass computes: always log-probs and entropy, the exact KL with a reference head,
        the support statistics with truncation, the log-probs at the teacher's top-k ids with ``candidates``, the
        exact KL to the reference beside the teacher's with ``regularizer``."""
        return (
            ("logprobs", "entropy")
            + (("kl",) if exact_kl else ())
            + (SUPPORT_KEYS if truncated else ())
            + (("candidate_logprobs",) if candidates else ())
            + (("regularizer_kl",) if regularizer else ())
        )


@dataclass(frozen=True)
class MicrobatchStats:
    """One microbatch's per-token statistics, masked and over whole sequences ``[b, S-1]`` (a context-parallel
    shard's gathered back), with its ``rows`` of the batch: what a pass collects per microbatch before
    ``pipeline.assemble_token_stats`` puts the batch's :class:`TokenStats` together."""

    rows: torch.Tensor
    stats: TokenStats
