"""Where a spawned rank computes: its GPU under nccl (one GPU per rank), the CPU under gloo."""

import torch
import torch.distributed as dist

from megatron_kl.models.parallel import collective_device


def rank_device() -> torch.device:
    return collective_device() if dist.is_initialized() else torch.device("cpu")


def to_device(tree, device):
    """Tensors of a (nested) dict/list moved to ``device``; other values as they are."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {key: to_device(value, device) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(value, device) for value in tree)
    return tree
