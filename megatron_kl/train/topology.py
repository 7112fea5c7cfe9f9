"""This rank's place in the parallel layout, by name: data-parallel rank and size, and the process groups.

Read once from megatron-core's ``parallel_state`` after ``models.parallel.initialize`` and passed explicitly to
whatever needs a group (the step, evaluation, rollouts), instead of a tuple read by position or a global looked
up where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object = None  # None: the default group (one process, or tests without a layout)
    tp_group: object = None
    pp_group: object = None
    cp_group: object = None  # None without context parallelism
    is_logger: bool = True  # writes metrics, TensorBoard and the summary: last pipeline stage, TP rank 0, DP rank 0

    @classmethod
    def from_parallel_state(cls) -> "Topology":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_kl.models import parallel, pipeline

        dp_group = ps.get_data_parallel_group()
        is_logger = (
            ps.is_pipeline_last_stage()
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0
        )
        return cls(
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=dist.get_world_size(dp_group),
            dp_group=dp_group,
            tp_group=parallel.tp_group(),
            pp_group=parallel.pp_group(),
            cp_group=pipeline.context_parallel_group(),
            is_logger=is_logger,
        )
