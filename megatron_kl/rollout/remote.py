"""A served engine (SGLang, vLLM) seen from a multi-rank trainer, behind the same protocol as the embedded one.

Global rank 0 owns the engine: it starts or connects to the servers and pushes the weights. Every rank calls
``generate`` with its data-parallel shard; the prompts are gathered on rank 0, generated once per
data-parallel replica (its tensor/pipeline peers hold the same prompts and seed; each replica's prompts go
out as one concurrent batch), and each rank gets its replica's completions back. ``update_weights`` is
collective: every rank takes part in gathering the policy over TP and PP (HF layout, one tensor at a time)
and rank 0 streams it to the servers.

The prompt gather and completion scatter run on a process group of their own (gloo, object collectives), so
``generate`` may run in a background thread (asynchronous rollouts, ``train.staleness > 0``) while the main
thread trains with collectives on the model's groups.
"""

from __future__ import annotations

from datetime import timedelta

from typing import Callable, Optional, Sequence

import torch.distributed as dist

from megatron_kl.rollout.engine import Completion, SamplingConfig


class DistributedEngine:
    def __init__(self, make_engine: Callable[[], object], model, dp_rank: int, tp_group=None, pp_group=None,
                 include_tied_head: bool = False, timeout_s: float = 1800.0):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.engine = make_engine() if self.rank == 0 else None
        self.model, self.dp_rank, self.tp_group, self.pp_group = model, dp_rank, tp_group, pp_group
        self.include_tied_head = include_tied_head
        self.weight_version = 0
        self.object_group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                             if self.world > 1 else None)
        if self.world > 1:
            dist.barrier()  # the servers are up before anyone generates

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seed: Optional[int] = None) -> list[Completion]:
        mine = (self.dp_rank, [list(p) for p in prompts], seed)
        if self.world == 1:
            return self._generate_replicas([mine], sampling)[self.dp_rank]
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.object_group)
        by_replica = self._generate_replicas(gathered, sampling) if self.rank == 0 else None
        out = [None]
        scatter = [by_replica[r] for r in self._replica_of_ranks(gathered)] if self.rank == 0 else None
        dist.scatter_object_list(out, scatter, src=0, group=self.object_group)
        return out[0]

    @staticmethod
    def _replica_of_ranks(gathered) -> list[int]:
        return [entry[0] for entry in gathered]

    def _generate_replicas(self, gathered, sampling: SamplingConfig) -> dict[int, list[Completion]]:
        """One generation per data-parallel replica, all replicas' prompts in one concurrent batch."""
        replicas: dict[int, tuple] = {}
        for dp_rank, prompts, seed in gathered:
            replicas.setdefault(dp_rank, (prompts, seed))
        out = {}
        for dp_rank, (prompts, seed) in replicas.items():
            out[dp_rank] = self.engine.generate(prompts, sampling, seed=seed)
        if hasattr(self.engine, "release_memory"):
            self.engine.release_memory()
        return out

    def update_weights(self, chunks: list, version: int) -> None:
        from megatron_kl.models.output_head import unwrap
        from megatron_kl.rollout.weight_sync import hf_named_tensors

        named = hf_named_tensors([unwrap(c) for c in chunks], self.model, self.tp_group, self.pp_group,
                                 self.include_tied_head)
        if self.rank == 0:
            self.engine.update_weights(named, version)
        else:
            for _ in named:  # take part in the gather
                pass
        self.weight_version = version
        if self.world > 1:
            dist.barrier()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
