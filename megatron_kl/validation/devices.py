"""Where a spawned rank computes: its GPU under nccl (one GPU per rank), the CPU under gloo."""

import torch
import torch.distributed as dist

from megatron_kl.models.parallel import collective_device


def rank_device() -> torch.device:
    return collective_device() if dist.is_initialized() else torch.device("cpu")
