"""Routing replay for mixture-of-experts policies: the trainer's forwards route rollout tokens to the experts the
rollout engine chose (``model.moe.routing_replay: rollout``), with megatron-core's ``RouterReplay``.

Layout of a routing: ``routed_experts [B, S, L, k]`` integer expert ids for every input position of a batch
(the token at position s of row b, layer l, top-k slot), ``UNKNOWN`` (-1) where the engine did not route the
token: the last response token is sampled but never fed to the model (engines report P + R - 1 positions, as
SGLang does), and padding. A megatron router sees its layer's tokens sequence-major (``[s, b]`` flattened; each
tensor-parallel rank its own contiguous slice of s under sequence parallelism), so a microbatch's ids are
transposed and sliced the same way before they reach it.

Why replay: the engine and the trainer compute the router logits with different kernels (incremental decoding vs
a full forward, other batch shapes); where two experts' logits are within rounding of each other the two pick
different experts and the trainer's pi_old(y|s) is the log-prob of another network than the one that sampled -
an off-policy gap no importance weight over tokens accounts for. With replay, pi_theta(y|s) is the policy with
the rollout's expert choice held fixed (the router's gate values and their gradient still come from the
trainer's weights: megatron gathers the trainer's scores at the replayed indices).

The reference is never replayed: KL(pi_theta || pi_ref) regularises toward the frozen reference network, whose
routing is part of what pi_ref is; replaying the policy's rollout routing into it would make the reference
depend on the policy's weights (a moving target, and an estimator of a KL to no fixed distribution).

Positions with ``UNKNOWN`` ids are given experts 0..k-1: they feed no log-prob that is read (the last position
predicts past the sequence; padding is masked, and causal attention keeps both out of earlier positions). With a
capacity factor such positions also take expert capacity, as padding does without replay.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

UNKNOWN = -1


def routers(chunks: list) -> list:
    """Every megatron-core ``TopKRouter`` of the model chunks (one per MoE layer held here)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def _new_replay(router):
    """A ``RouterReplay`` owned by ``router`` alone: megatron-core also registers every instance in a class-level
    list (for its global set/clear calls, which this project does not use); taking it out keeps the policy's, the
    reference's and the engine's routers apart."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    replay = RouterReplay()
    instances = RouterReplay.global_router_replay_instances
    if instances and instances[-1] is replay:
        instances.pop()
    router.router_replay = replay
    return replay


def is_recompute(router) -> bool:
    """A router call that recomputes a layer in backward (megatron's full activation recomputation: the original
    forward runs inside a checkpoint function with autograd off, the recomputation with it on)."""
    return getattr(router.config, "recompute_granularity", None) == "full" and torch.is_grad_enabled()


def _choose_action(router, _args) -> None:
    """Before every call of a replaying router: the microbatch's rollout ids in a forward, the ids of the oldest
    microbatch not yet through backward in a recomputation (schedules run backwards in forward order), and the
    router's own choice when no ids were given."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = router.router_replay
    if getattr(router, "_replay_suspended", False):
        replay.clear_router_replay_action()
        return
    if is_recompute(router):
        action = RouterReplayAction.REPLAY_BACKWARD if replay.replay_backward_list else None
    else:
        action = RouterReplayAction.REPLAY_FORWARD if replay.target_topk_idx is not None else None
    if action is None:
        replay.clear_router_replay_action()
    else:
        replay.set_router_replay_action(action)


def attach_replay(chunks: list) -> None:
    """Make the routers of the policy ``chunks`` replay the ids :func:`load_microbatch` gives them."""
    for router in routers(chunks):
        if getattr(router, "_replay_hook", None) is None:
            _new_replay(router)
            router._replay_hook = router.register_forward_pre_hook(_choose_action)


@contextmanager
def suspended(chunks: list):
    """Inside the block the policy's routers route by themselves even where rollout ids are loaded (the metric
    of what the mismatch would be without replay)."""
    attached = [r for r in routers(chunks) if getattr(r, "_replay_hook", None) is not None]
    for router in attached:
        router._replay_suspended = True
    try:
        yield
    finally:
        for router in attached:
            router._replay_suspended = False


def _router_ids(router, routed_experts: torch.Tensor, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """The ids ``router`` sees, on its device: ``[B, S, L, k]`` -> its layer's ``[S(/tp) * B, k]``, sequence-major
    (``tp_size`` > 1: this rank's sequence slice under sequence parallelism)."""
    ids = routed_experts[:, :, router.layer_number - 1].transpose(0, 1)
    if tp_size > 1:
        ids = ids.chunk(tp_size, dim=0)[tp_rank]
    return ids.reshape(-1, ids.shape[-1]).to(router.weight.device)


def _fill_unknown(ids: torch.Tensor) -> torch.Tensor:
    """Positions without a rollout routing get experts 0..k-1 (their outputs are never read)."""
    missing = (ids < 0).any(-1, keepdim=True)
    placeholder = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    return torch.where(missing, placeholder, ids).long()


def load_microbatch(
    chunk, routed_experts: torch.Tensor, sequence_parallel: bool, tp_rank: int = 0, tp_size: int = 1
) -> None:
    """Give each router of ``chunk`` its layer's rollout ids for the coming forward of one microbatch:
    ``router.rollout_topk`` (ids with UNKNOWN rows, for :mod:`megatron_kl.models.moe_load`'s agreement count) and,
    on a replaying router, megatron's replay target (queued for a recomputation in backward too)."""
    split = tp_size if sequence_parallel else 1
    for router in routers([chunk]):
        ids = _router_ids(router, routed_experts, tp_rank, split)
        router.rollout_topk = ids
        if getattr(router, "_replay_hook", None) is not None:
            router.router_replay.set_target_indices(_fill_unknown(ids))


def clear(chunks: list) -> None:
    """Forget every loaded routing (after a schedule: the backward queue of a forward-only pass is never drained)."""
    for router in routers(chunks):
        router.rollout_topk = None
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


@contextmanager
def replayed(model, routed_experts: torch.Tensor):
    """Forwards of ``model`` (one chunk, no sequence parallelism) inside the block route as ``routed_experts
    [B, S, L, k]`` says (UNKNOWN positions to experts 0..k-1); each router's previous mode comes back after."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    saved = []
    for router in routers([model]):
        replay = router.router_replay if router.router_replay is not None else _new_replay(router)
        saved.append((replay, replay.router_replay_action))
        replay.set_target_indices(_fill_unknown(_router_ids(router, routed_experts)))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for replay, action in saved:
            replay.clear_indices()
            replay.router_replay_action = action


def own_routing_map(router, hidden: torch.Tensor) -> torch.Tensor:
    """``[tokens, experts]``: True at the experts the router picks by itself for its input ``hidden`` (its own
    top-k of its own logits, before any capacity drop), whatever it was told to replay."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    with torch.no_grad():
        logits = router.gating(hidden).view(-1, router.config.num_moe_experts)
        _, routing_map = topk_routing_with_score_function(
            logits,
            router.topk,
            use_pre_softmax=router.config.moe_router_pre_softmax,
            num_groups=router.config.moe_router_num_groups,
            group_topk=router.config.moe_router_group_topk,
            scaling_factor=router.config.moe_router_topk_scaling_factor,
            score_function=router.score_function,
            expert_bias=router.expert_bias,
        )
    return routing_map


class RoutingRecorder:
    """The embedded engine's record of its routing: every router of its replica records its top-k ids
    (megatron's ``RouterReplay`` in record mode); :meth:`take` returns the last forward's as ``[B, n, L, k]``."""

    def __init__(self, model, num_layers: int):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.routers = sorted(routers([model]), key=lambda r: r.layer_number)
        self.num_layers = num_layers
        for router in self.routers:
            _new_replay(router).set_router_replay_action(RouterReplayAction.RECORD)

    def take(self, batch: int, length: int) -> Optional[torch.Tensor]:
        """The ids of the last forward over ``[batch, length]`` tokens: ``[batch, length, L, k]`` int16 (None for a
        dense model)."""
        if not self.routers:
            return None
        out = None
        for router in self.routers:
            ids = router.router_replay.get_recorded_indices()
            ids = ids.view(length, batch, -1).transpose(0, 1).to("cpu", torch.int16)
            if out is None:
                out = torch.full((batch, length, self.num_layers, ids.shape[-1]), UNKNOWN, dtype=torch.int16)
            out[:, :, router.layer_number - 1] = ids
            router.router_replay.record_indices(None)
        return out
