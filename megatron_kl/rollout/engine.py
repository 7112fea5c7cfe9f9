"""The rollout-engine protocol shared by the embedded engine, SGLang and vLLM.

An engine turns prompts (token ids) into completions: the sampled response ids, the behaviour
log-probs ``log mu(y_t | s_t)`` of the sampled tokens under the engine's sampling temperature, and the
weight version that produced them. The trainer pushes new weights with ``update_weights``.

Behaviour log-probs are those of the distribution that sampled: mu = trunc(softmax(logits / T)) (top-k /
top-p support, renormalised; the full softmax(logits / T) when nothing is truncated). With
``rollout.sampling.distribution=truncated`` (the default) the trainer's log-probs, entropy and exact KL are
mu's too, so training is on-policy; with ``full`` the trainer differentiates the full softmax while the
samples come from mu: the run is tagged kl/biased and the mismatch metrics show the gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

from megatron_kl.rollout.config import DISTRIBUTIONS, SamplingConfig  # noqa: F401
from megatron_kl.rollout.http import CorruptResponse

FINISH_REASONS = ("stop", "length")
PAUSED = "abort"  # a generation cut off by a pause (SGLang's finish_reason type): its response is a prefix to resume


@dataclass
class Completion:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # behaviour log-probs, one per response token
    finish_reason: str  # "stop" | "length", or "abort" for a partial response paused by ``pause``
    weight_version: int  # the newest weights that sampled any of its tokens
    # mixture-of-experts engines that report their routing: the experts every fed token was routed to,
    # [P + R - 1, layers, top-k] integer ids (the prompt and every response token but the last, which is sampled
    # and never fed), as SGLang's meta_info.routed_experts; None when the engine does not report it
    routed_experts: Optional[torch.Tensor] = field(default=None, compare=False)
    # the weight version that sampled each response token (a response resumed across weight updates spans several);
    # None: every token is ``weight_version``'s
    token_versions: Optional[list[int]] = None

    def __post_init__(self):
        if len(self.response_ids) != len(self.response_logprobs):
            raise ValueError(
                f"completion has {len(self.response_ids)} response ids but {len(self.response_logprobs)} log-probs"
            )
        if self.finish_reason not in FINISH_REASONS + (PAUSED,):
            raise ValueError(
                f"completion finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS + (PAUSED,)}"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(
                f"completion has {len(self.response_ids)} response ids but {len(self.token_versions)} token versions"
            )

    @property
    def finished(self) -> bool:
        """False for a response paused mid-generation (to be resumed from its prefix)."""
        return self.finish_reason != PAUSED

    @property
    def versions(self) -> list[int]:
        """The weight version of every response token (the behaviour policy that sampled it)."""
        return (
            list(self.token_versions)
            if self.token_versions is not None
            else [self.weight_version] * len(self.response_ids)
        )

    @property
    def routed_positions(self) -> int:
        """How many positions a reported routing covers: every fed token (P + R - 1)."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


class EngineLost(RuntimeError):
    """The rollout servers stayed unavailable after the retries and restarts (or could not be reached at start).
    Raised on every trainer rank together, so the trainer can checkpoint and stop for a requeue."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer calls on its engine (every member; :class:`EngineBase` gives the optional ones defaults).

    ``update_weights(chunks, version)`` takes the policy's Megatron model chunks on this rank; a served engine's
    :class:`megatron_kl.rollout.distributed.DistributedEngine` gathers them into HF-named tensors for the
    :class:`ServedEngine` behind it."""

    weight_version: int
    # several ranks call generate() as a collective: calls must not overlap (rollouts run them from one thread)
    collective_generate: bool
    # calls from several threads run concurrently (partial rollouts overlap the next batch with the one in flight)
    overlapping_generate: bool

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: Optional[int] = None,
        budgets: Optional[Sequence[int]] = None,
    ) -> list[Completion]:
        """One completion per prompt, in order. ``seed`` makes the draw reproducible; ``budgets`` (partial rollouts)
        caps each prompt's new tokens (a resumed response's remaining budget)."""

    def update_weights(self, source, version: int) -> None:
        """Load the policy's current weights and tag them ``version``."""

    @property
    def last_sync(self):
        """The last weight sync's statistics (rollout/delta.SyncStats), or None."""

    def pause(self) -> None:
        """Partial rollouts (``rollout.partial``): make every ``generate`` in flight return promptly, responses not yet
        finished cut where they are with finish_reason ``"abort"`` (their tokens and behaviour log-probs kept);
        ``resume`` lets generation run again."""

    def resume(self) -> None: ...

    def shutdown(self) -> None:
        """Release resources (servers, memory)."""


class EngineBase:
    """Defaults of the optional members for engines that lack them: one caller at a time, no sync statistics, no
    pause (an engine that can pause says so in its registry entry, ``EngineSpec.can_pause``, and overrides both)."""

    weight_version: int = 0
    collective_generate: bool = False
    overlapping_generate: bool = False
    last_sync = None

    def pause(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot pause a generation (rollout.partial)")

    def resume(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot pause a generation (rollout.partial)")

    def shutdown(self) -> None:
        pass


class ServedEngine(Protocol):
    """A server-backed engine as :class:`DistributedEngine` drives it from global rank 0: ``update_weights`` takes
    ``(hf_name, tensor)`` pairs streamed from the gather; ``release_memory`` hands memory back after a generation
    (colocated servers)."""

    weight_version: int
    last_sync: object

    def generate(
        self, prompts, sampling: SamplingConfig, seed: Optional[int] = None, **budgets
    ) -> list[Completion]: ...

    def update_weights(self, named_tensors, version: int) -> None: ...

    def release_memory(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def shutdown(self) -> None: ...


def checked_budgets(budgets, count: int, sampling: SamplingConfig) -> Optional[list[int]]:
    """Per-prompt new-token budgets (resumed responses) as ints, one per prompt, each in [1, max_new_tokens];
    None stays None (every prompt gets max_new_tokens)."""
    if budgets is None:
        return None
    budgets = [int(b) for b in budgets]
    if len(budgets) != count or any(not 1 <= b <= sampling.max_new_tokens for b in budgets):
        raise ValueError(f"budgets: one per prompt ({count}), each in [1, max_new_tokens={sampling.max_new_tokens}]")
    return budgets


LOGPROB_ROUNDING = 1e-4  # servers round log-probs; a positive value beyond this is not a probability


def check_completion(completion: "Completion", sampling: SamplingConfig, vocab_size: Optional[int], where: str) -> None:
    """A served completion's values, checked before anything uses them: at most ``max_new_tokens`` response
    ids, each in [0, vocab_size), and finite behaviour log-probs <= 0. Raises ``CorruptResponse`` naming
    the field, the position and the server (``where``)."""
    ids, logprobs = completion.response_ids, completion.response_logprobs
    if len(ids) > sampling.max_new_tokens:
        raise CorruptResponse(
            f"{where}: {len(ids)} response tokens, more than rollout.sampling.max_new_tokens={sampling.max_new_tokens}"
        )
    for position, token in enumerate(ids):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise CorruptResponse(
                f"{where}: response token id {token} at position {position} is outside the vocabulary [0, {vocab_size})"
            )
    for position, value in enumerate(logprobs):
        if not math.isfinite(value) or value > LOGPROB_ROUNDING:
            raise CorruptResponse(
                f"{where}: behaviour log-prob {value} at response position {position} is not a finite value <= 0"
            )


def check_routing(
    completion: "Completion", num_layers: int, router_topk: int, num_experts: int, where: str, dense_layers: int = 0
) -> None:
    """A reported routing's shape ``[P + R - 1, num_layers, router_topk]`` and ids in [0, num_experts), each token's
    top-k distinct; raises ``CorruptResponse`` naming the first bad position. The first ``dense_layers`` layers
    have no router (``model.moe.first_dense_layers``): whatever a server writes there is not checked."""
    routing = completion.routed_experts
    expected = (completion.routed_positions, num_layers, router_topk)
    if routing is None or tuple(routing.shape) != expected:
        shape = None if routing is None else tuple(routing.shape)
        raise CorruptResponse(
            f"{where}: routed experts of shape {shape}, expected {expected} (prompt + response - 1 "
            "positions, model.num_layers, model.moe.router_topk)"
        )
    routed = routing[:, dense_layers:]
    bad = (routed < 0) | (routed >= num_experts)
    if routed.shape[-1] > 1:
        ordered = routed.sort(-1).values
        bad = bad | torch.nn.functional.pad(ordered[..., 1:] == ordered[..., :-1], (1, 0))
    if bool(bad.any()):
        position, layer, _ = (int(i) for i in bad.nonzero()[0])
        layer += dense_layers
        raise CorruptResponse(
            f"{where}: routed experts at position {position}, layer {layer} are "
            f"{routing[position, layer].tolist()}: not {router_topk} distinct ids in "
            f"[0, model.moe.num_experts={num_experts})"
        )
