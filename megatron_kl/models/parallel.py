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
from megatron_kl.megatron_compat import apply_cpu_shims


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
    from megatron.core import parallel_state, tensor_parallel

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
    """The process groups of a model that runs in a tensor-parallel layout of its own beside the trainer's (a
    distillation teacher at another TP size): ``tp`` this rank's group of ``tensor_parallel`` consecutive ranks
    (megatron's order), ``replica`` its index among the ``replicas`` = world / tensor_parallel groups, and
    ``collection`` megatron's ProcessGroupCollection to build and run the model with (whole layers on every rank: no
    pipeline or context parallelism of its own)."""

    tp: object
    tensor_parallel: int
    replica: int
    replicas: int
    collection: object


def own_layout(tensor_parallel: int, timeout_s: float) -> OwnLayout:
    """Collective: every rank creates the groups of a ``tensor_parallel``-wide layout (its own TP groups, and one
    single-rank group per rank for the pipeline, context, embedding and data-parallel roles), with the trainer's
    ``parallel.distributed_timeout_s``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide the world of {world} ranks")
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    tp, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, i + tensor_parallel)) for i in range(0, world, tensor_parallel)], **kwargs)
    single, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)], **kwargs)
    collection = ProcessGroupCollection()
    collection.tp = collection.tp_cp = collection.mp = tp
    for role in ("pp", "cp", "embd", "pos_embd", "dp", "dp_cp"):
        setattr(collection, role, single)
    return OwnLayout(tp, tensor_parallel, rank // tensor_parallel, world // tensor_parallel, collection)
