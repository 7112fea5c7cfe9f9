"""Checkpoints with megatron.core.dist_checkpointing: model and optimizer as sharded tensors (any rank
layout reads them back), plus the trainer state: step, LR schedule, RNG states (per rank), the data cursor
(the step) and the async rollout queue.

A checkpoint is written to ``step_XXXXXX.tmp`` and renamed once every rank has finished, so a run killed
mid-save (kill -9) leaves the previous checkpoint as the latest complete one.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_kl.models.optim import unwrap

_PREFIX = "step_"


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded_state_dict(train_state, is_loading: bool) -> dict:
    """Model chunks under ``model`` (``model0``, ``model1``... with virtual stages) and the optimizer."""
    sharded = {key: unwrap(chunk).sharded_state_dict()
               for key, chunk in zip(_model_keys(train_state.chunks), train_state.chunks)}
    model_flat = {}
    for value in sharded.values():
        model_flat.update(value)
    sharded["optimizer"] = train_state.optimizer.sharded_state_dict(model_flat, is_loading=is_loading)
    return sharded


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def latest_checkpoint(directory: Path) -> Optional[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        return None
    done = sorted(p for p in directory.glob(f"{_PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def save_checkpoint(directory: Path, step: int, train_state, trainer_state: dict, rank_state: dict,
                    keep: int = 2) -> Path:
    """Collective. ``trainer_state`` is the same on all ranks (saved by rank 0); ``rank_state`` per rank."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    final = directory / f"{_PREFIX}{step:06d}"
    tmp = directory / f"{_PREFIX}{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(train_state, is_loading=False), str(tmp))
    torch.save(rank_state, tmp / f"rank_{dist.get_rank():05d}.pt")
    if dist.get_rank() == 0:
        torch.save({**trainer_state, "step": step, "scheduler": train_state.scheduler.state_dict()}, tmp / "trainer.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in sorted(p for p in directory.glob(f"{_PREFIX}*") if not p.name.endswith(".tmp"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: Path, train_state) -> tuple[dict, dict]:
    """Load model + optimizer into ``train_state``; return (trainer_state, this rank's rank_state)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    trainer_file = path / "trainer.pt"
    if not trainer_file.is_file():
        raise FileNotFoundError(f"checkpoint {path} lacks trainer.pt: it is incomplete; delete it or pick another")
    loaded = dist_checkpointing.load(_sharded_state_dict(train_state, is_loading=True), str(path))
    for key, chunk in zip(_model_keys(train_state.chunks), train_state.chunks):
        unwrap(chunk).load_state_dict(loaded[key])
    train_state.optimizer.load_state_dict(loaded["optimizer"])
    trainer_state = torch.load(trainer_file, map_location="cpu", weights_only=False)
    train_state.scheduler.load_state_dict(trainer_state.pop("scheduler"))
    train_state.step = trainer_state["step"]
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.is_file() else {}
    return trainer_state, rank_state
