"""A process group's size and rank, and the two collectives the KL kernels use, where ``None`` (or no initialised
torch.distributed) is one rank and a collective over one rank does nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size_rank(group) -> tuple[int, int]:
    """(world size, this rank) of ``group``; (1, 0) for None or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    """``tensor`` reduced in place over ``group`` (nothing to do on one rank); returns it."""
    if group_size_rank(group)[0] > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_columns(local: torch.Tensor, group) -> torch.Tensor:
    """[n, m] per rank -> [n, world * m], the ranks' columns in rank order."""
    world = group_size_rank(group)[0]
    if world == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
