"""Expert load of a mixture-of-experts policy: how many tokens each layer's router sends to each expert.

A forward hook on every megatron-core ``TopKRouter`` of the chunks adds its routing map (``[tokens, experts]``,
after any capacity drop) into a ``[layers, experts]`` count while :meth:`ExpertLoad.recording` is active; the
trainer records the pass that computes pi_old (one forward per token of the step). Counts cover the tokens the
router saw, padding positions of a padded microbatch included - except where the engine reported its routing: then
only the tokens it routed (every prompt and response token but each sequence's last) count.

Where the engine reported its routing (``router.rollout_topk``, set per microbatch by
:mod:`megatron_kl.models.routing_replay`) the same hook counts how many of the rollout's k experts the router would
pick by itself (its own top-k of its own logits, whether or not it replays the rollout's): ``moe/routing_agreement``
is that count over k x the routed (token, layer) pairs, 1 when trainer and engine route alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist

from megatron_kl.models.parallel import all_reduce_cpu
from megatron_kl.models.routing_replay import is_recompute, own_routing_map, routers


class ExpertLoad:
    """Tokens per expert per layer over one recorded pass; ``metrics()`` reduces them over the given groups
    (data-parallel ranks see different tokens, pipeline stages hold different layers)."""

    def __init__(self, chunks: list, num_layers: int, num_experts: int, router_topk: int):
        self.routers = routers(chunks)
        self.router_topk = router_topk
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.tokens = torch.zeros(num_layers, dtype=torch.float64)
        self.agreement = torch.zeros(2, dtype=torch.float64)  # (rollout experts the router picks too, routed slots)

    @contextmanager
    def recording(self):
        """Count the routing of every router call inside the block (counts start from zero)."""
        self.counts.zero_()
        self.tokens.zero_()
        self.agreement.zero_()
        handles = [router.register_forward_hook(self._hook) for router in self.routers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, router, inputs, output) -> None:
        if is_recompute(router):  # the layer recomputed in backward: its forward was counted
            return
        routing_map = output[1].detach()
        layer = router.layer_number - 1  # megatron's global, 1-based layer number
        rollout = getattr(router, "rollout_topk", None)
        if rollout is not None:  # only the tokens the engine routed (padding and replay's placeholders left out)
            routed = (rollout >= 0).all(-1)
            routing_map = routing_map[routed]
            picked = own_routing_map(router, inputs[0])[routed].gather(1, rollout[routed].long())
            self.agreement += torch.tensor([float(picked.sum()), float(picked.numel())], dtype=torch.float64)
        self.counts[layer] += routing_map.sum(0).to("cpu", torch.float64)
        self.tokens[layer] += routing_map.shape[0]

    def metrics(self, groups: tuple = (), capacity: bool = False) -> dict:
        """``moe/tokens_per_expert_{max,min,mean}`` over experts and layers, ``moe/load_imbalance`` (the most
        loaded expert over the mean: 1 is balanced), and with a capacity factor ``moe/dropped_fraction`` (routes
        the capacity dropped over tokens x top-k)."""
        counts, tokens, agreement = self.counts.clone(), self.tokens.clone(), self.agreement.clone()
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                counts, tokens = all_reduce_cpu(counts, group), all_reduce_cpu(tokens, group)
                agreement = all_reduce_cpu(agreement, group)
        seen = tokens > 0
        if not bool(seen.any()):
            return {}
        counts = counts[seen]
        mean = float(counts.mean())
        out = {
            "moe/tokens_per_expert_max": float(counts.max()),
            "moe/tokens_per_expert_min": float(counts.min()),
            "moe/tokens_per_expert_mean": mean,
            "moe/load_imbalance": float(counts.max()) / max(mean, 1e-12),
        }
        if agreement[1] > 0:
            out["moe/routing_agreement"] = float(agreement[0] / agreement[1])
        if capacity:
            routes = float(tokens[seen].sum()) * self.router_topk
            out["moe/dropped_fraction"] = 1.0 - float(counts.sum()) / max(routes, 1e-12)
        return out


def expert_load(chunks: list, model) -> Optional[ExpertLoad]:
    """An :class:`ExpertLoad` for a mixture-of-experts ``model`` (ModelConfig), None for a dense one."""
    if not model.moe.enabled:
        return None
    return ExpertLoad(chunks, model.num_layers, model.moe.num_experts, model.moe.router_topk)
