"""Process groups: torch.distributed + megatron-core model-parallel state.

``initialize(parallel)`` is the one place that creates groups. It picks nccl when CUDA is available
and gloo otherwise, applies the CPU shims in the latter case, and seeds megatron's RNG tracker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_kl.config import ModelConfig, ParallelConfig, validate_parallel
from megatron_kl.megatron_compat import apply_cpu_shims, import_megatron_core


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def collective_device(group=None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this rank's CUDA device for nccl, the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_cpu(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce of a CPU tensor over ``group``, on the device the group's backend takes; the result on the CPU."""
    tensor = tensor.to(collective_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.cpu()


def initialize(model: ModelConfig, parallel: ParallelConfig, seed: int = 1234) -> None:
    """Create the global group (from torchrun-style env vars if needed) and megatron's TP/PP groups, all
    with ``parallel.distributed_timeout_s``.

    The config is validated against the world size before megatron's groups are created.
    """
    import_megatron_core()  # first, so that on a CPU its torch.compile decorators are deferred
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=default_backend(), timeout=timedelta(seconds=parallel.distributed_timeout_s))
    validate_parallel(model, parallel, dist.get_world_size())
    apply_cpu_shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=parallel.distributed_timeout_s / 60.0,  # megatron: timedelta(minutes=...)
    )
    reseed(seed)


def reseed(seed: int) -> None:
    """Seed torch's default generator and megatron's model-parallel RNG tracker (weight init, dropout)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def pp_group():
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


@dataclass(frozen=True)
class OwnLayout:
    """The process groups of a model that runs in a layout of its own beside the trainer's (a distillation teacher at
    another tensor / pipeline size): world / (tensor_parallel x pipeline_parallel) replicas of consecutive ranks, in
    megatron's order inside each (rank = replica start + stage x tensor_parallel + tensor rank). ``tp`` this rank's
    tensor-parallel group, ``pp`` its pipeline group (a one-rank group without pipelining), ``stage`` its pipeline
    stage, ``replica`` its replica's index among ``replicas``, ``collection`` megatron's ProcessGroupCollection to build
    and run the model with (no context or data parallelism of its own)."""

    tp: object
    tensor_parallel: int
    replica: int
    replicas: int
    collection: object
    pp: object = None
    pipeline_parallel: int = 1
    stage: int = 0

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pipeline_parallel - 1


def own_layout(tensor_parallel: int, timeout_s: float, pipeline_parallel: int = 1) -> OwnLayout:
    """Collective: every rank creates the groups of a ``tensor_parallel`` x ``pipeline_parallel`` layout (its own TP
    and pipeline groups, the embedding group of each pipeline's first and last stage, and one single-rank group per
    rank for the context and data-parallel roles), with the trainer's ``parallel.distributed_timeout_s``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    size = tensor_parallel * pipeline_parallel
    if world % size:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} does not divide "
            f"the world of {world} ranks"
        )
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    bases = range(0, world, size)

    def members(base: int, stage: int) -> list[int]:
        return [base + stage * tensor_parallel + t for t in range(tensor_parallel)]

    tp, _ = dist.new_subgroups_by_enumeration(
        [members(b, p) for b in bases for p in range(pipeline_parallel)], **kwargs
    )
    pp, _ = dist.new_subgroups_by_enumeration(
        [
            [b + p * tensor_parallel + t for p in range(pipeline_parallel)]
            for b in bases
            for t in range(tensor_parallel)
        ],
        **kwargs,
    )
    replica_group, _ = dist.new_subgroups_by_enumeration([list(range(b, b + size)) for b in bases], **kwargs)
    ends = sorted({0, pipeline_parallel - 1})
    embedding, _ = dist.new_subgroups_by_enumeration(
        [[b + p * tensor_parallel + t for p in ends] for b in bases for t in range(tensor_parallel)], **kwargs
    )
    single, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)], **kwargs)
    stage = (rank % size) // tensor_parallel
    collection = ProcessGroupCollection()
    collection.tp = collection.tp_cp = tp
    collection.mp = replica_group
    collection.pp = pp
    collection.embd = embedding if stage in ends else single
    # mixture-of-experts layers: every expert on every rank (no expert parallelism of its own), split as the dense
    # layers are over the layout's tensor-parallel group
    collection.expt_tp = collection.tp_ep = collection.tp_dp_cp = tp
    collection.tp_ep_pp = replica_group
    for role in ("cp", "pos_embd", "dp", "dp_cp", "ep", "expt_dp", "intra_dp_cp", "intra_expt_dp"):
        setattr(collection, role, single)
    return OwnLayout(tp, tensor_parallel, rank // size, world // size, collection, pp, pipeline_parallel, stage)
