"""Size and rank of a process group, where ``None`` (or no initialised torch.distributed) is one rank."""

from __future__ import annotations

import torch.distributed as dist


def group_size_rank(group) -> tuple[int, int]:
    """(world size, this rank) of ``group``; (1, 0) for None or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
