"""A served engine (SGLang, vLLM) seen from a multi-rank trainer, behind the same protocol as the embedded one.

Global rank 0 owns the engine: it starts or connects to the servers and pushes the weights. Every rank calls
``generate`` with its data-parallel shard; the prompts are gathered on rank 0, generated once per
data-parallel replica (its tensor/pipeline peers hold the same prompts and seed; each replica's prompts go
out as one concurrent batch), and each rank gets its replica's completions back. ``update_weights`` is
collective: every rank takes part in gathering the policy over TP and PP (HF layout, one tensor at a time)
and rank 0 streams it to the servers.

Failures reach every rank together: if rank 0 cannot start or reach its servers (``ServerUnavailable`` after
the retries and restarts), it sends that in place of the result and every rank raises ``EngineLost`` instead of
waiting in a collective that rank 0 never joins.

The prompt gather and completion scatter run on a process group of their own (gloo, object collectives), so
``generate`` may run in a background thread (asynchronous rollouts, ``train.staleness > 0``) while the main
thread trains with collectives on the model's groups.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_kl.models.hf import to_hf_stream
from megatron_kl.models.output_head import unwrap
from megatron_kl.models.state import iter_full_state
from megatron_kl.rollout.engine import Completion, EngineBase, EngineLost, SamplingConfig
from megatron_kl.rollout.http import Cancelled, ServerUnavailable
from megatron_kl.rollout.servers import ServerStartFailed

LOST = "engine_lost"  # scattered / broadcast in place of a result when rank 0's servers are lost
FAILED = "engine_failed"  # ... when rank 0's engine raised anything else (the other ranks raise too)
STOPPED = "engine_stopped"  # ... when rank 0's calls were cancelled by a stop signal


def _marker(error: BaseException) -> dict:
    """What the other ranks receive in place of a result when rank 0's engine raised ``error``."""
    if isinstance(error, ServerStartFailed):  # permanent: no requeue
        return {FAILED: f"{type(error).__name__}: {error}"}
    if isinstance(error, ServerUnavailable):
        return {LOST: str(error)}
    if isinstance(error, Cancelled):
        return {STOPPED: str(error)}
    return {FAILED: f"{type(error).__name__}: {error}"}


def _raise_marker(value, own_error: Optional[BaseException], what: str) -> None:
    """Lost servers: ``EngineLost`` on every rank; any other error: raised on rank 0 (``own_error``), reported
    on the others; a result: nothing."""
    if not isinstance(value, dict):
        return
    if LOST in value:
        raise EngineLost(f"{what}: {value[LOST]}") from own_error
    if STOPPED in value:
        raise Cancelled(value[STOPPED]) from own_error
    if own_error is not None:
        raise own_error
    if FAILED in value:
        raise RuntimeError(f"rank 0's rollout engine failed {what}: {value[FAILED]}")


class DistributedEngine(EngineBase):
    def __init__(
        self,
        make_engine: Callable[[], object],
        model,
        dp_rank: int,
        tp_group=None,
        pp_group=None,
        include_tied_head: bool = False,
        timeout_s: float = 1800.0,
    ):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.model, self.dp_rank, self.tp_group, self.pp_group = model, dp_rank, tp_group, pp_group
        self.include_tied_head = include_tied_head
        self.weight_version = 0
        # several ranks: every generate is a collective, so calls must not overlap (rollouts run them in one thread)
        self.collective_generate = self.world > 1
        self.overlapping_generate = self.world == 1  # calls from several threads run concurrently on the servers
        self.object_group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.world > 1 else None
        )
        self.engine, error = None, None
        if self.rank == 0:
            try:
                self.engine = make_engine()
            except Exception as err:  # noqa: BLE001 - every rank stops with it
                error = err
        self._settle(error, "starting the rollout engine")  # the servers are up before anyone generates

    def _agree(self, value):
        """Rank 0's ``value`` on every rank (object broadcast on the engine's gloo group)."""
        if self.world == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self.object_group)
        return holder[0]

    def _settle(self, error: Optional[BaseException], what: str) -> None:
        """Every rank learns rank 0's outcome (``error`` there, None elsewhere) and raises accordingly."""
        _raise_marker(self._agree(None if error is None else _marker(error)), error, what)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: Optional[int] = None,
        budgets: Optional[Sequence[int]] = None,
    ) -> list[Completion]:
        """Collective over the trainer's ranks when there are several (each rank calls it the same number of times,
        in the same order, even with no prompts)."""
        mine = (self.dp_rank, [list(p) for p in prompts], seed, None if budgets is None else list(budgets))
        if self.world == 1:
            try:
                return self._generate_replicas([mine], sampling)[self.dp_rank]
            except ServerUnavailable as err:
                raise EngineLost(f"generating: {err}") from err
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.object_group)
        scatter, error = None, None
        if self.rank == 0:
            try:
                by_replica = self._generate_replicas(gathered, sampling)
                scatter = [by_replica[r] for r in self._replica_of_ranks(gathered)]
            except Exception as err:  # noqa: BLE001 - every rank stops with it
                error, scatter = err, [_marker(err)] * self.world
        out = [None]
        dist.scatter_object_list(out, scatter, src=0, group=self.object_group)
        _raise_marker(out[0], error, "generating")
        return out[0]

    @staticmethod
    def _replica_of_ranks(gathered) -> list[int]:
        return [entry[0] for entry in gathered]

    def _generate_replicas(self, gathered, sampling: SamplingConfig) -> dict[int, list[Completion]]:
        """One generation per data-parallel replica, all replicas' prompts in one concurrent batch."""
        replicas: dict[int, tuple] = {}
        for dp_rank, prompts, seed, budgets in gathered:
            replicas.setdefault(dp_rank, (prompts, seed, budgets))
        out = {}
        for dp_rank, (prompts, seed, budgets) in replicas.items():
            extra = {} if budgets is None else {"budgets": budgets}  # engines without partial rollouts lack it
            out[dp_rank] = self.engine.generate(prompts, sampling, seed=seed, **extra) if prompts else []
        self.engine.release_memory()
        return out

    def pause(self) -> None:
        """Partial rollouts: rank 0's engine cuts the generations in flight short (every rank's prompts go through
        it); the other ranks receive the partial completions through the scatter of their ``generate``. Collective:
        servers lost here raise ``EngineLost`` on every rank."""
        self._on_rank0(lambda: self.engine.pause(), "pausing generation")

    def resume(self) -> None:
        self._on_rank0(lambda: self.engine.resume(), "resuming generation")

    def _on_rank0(self, call: Callable[[], None], what: str) -> None:
        error = None
        if self.rank == 0:
            try:
                call()
            except Exception as err:  # noqa: BLE001 - every rank stops with it
                error = err
        self._settle(error, what)

    def update_weights(self, chunks: list, version: int) -> None:
        named = hf_named_tensors(
            [unwrap(c) for c in chunks], self.model, self.tp_group, self.pp_group, self.include_tied_head
        )
        error = None
        if self.rank == 0:
            try:
                self.engine.update_weights(named, version)
            except Exception as err:  # noqa: BLE001 - every rank stops with it, none waits in a gather
                error = err
        for _ in named:  # take part in the gather (all of it, or what rank 0 left after a failure)
            pass
        self._settle(error, f"pushing weight version {version}")
        self.weight_version = version

    @property
    def last_sync(self):
        """Rank 0's last weight sync statistics (rollout/delta.SyncStats; None elsewhere)."""
        return self.engine.last_sync if self.engine is not None else None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def hf_named_tensors(
    chunks: list, model, tp_group=None, pp_group=None, include_tied_head: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective over TP and PP: the policy as HF-named full tensors, one Megatron tensor at a time."""
    stream = iter_full_state(chunks, model.vocab_size, model.tie_word_embeddings, tp_group, pp_group)
    for hf_name, value in to_hf_stream(stream, model):
        yield hf_name, value
        if include_tied_head and model.tie_word_embeddings and hf_name == "model.embed_tokens.weight":
            yield "lm_head.weight", value
