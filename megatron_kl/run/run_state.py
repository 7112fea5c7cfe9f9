"""The run's stateful parts, registered in one place that saves and loads them (run/checkpoint.py).

A checkpoint holds three kinds of state, each a name -> object with ``state_dict()`` / ``load_state_dict()``:

- **sharded**: the model chunks and the optimizer (``TrainState``), written with megatron.core.dist_checkpointing
  so that any rank layout reads them back;
- **shared**: identical on every rank, written once by rank 0 to ``trainer.pt`` - the LR schedule and the
  step counters;
- **per rank**: each rank's own, ``rank_XXXXX.pt`` - RNG states and the asynchronous rollout queue (the data
  cursor is the RL step itself: batch ``s`` is drawn from a generator seeded by (seed, s, dp rank)).

The run's identity is not a state: it is ``run.json`` (run/run_dir.py), checked before anything is loaded.

Two counters, never one: an **RL step** is rollout -> reward -> KL -> update(s) -> weight sync; it runs
``algo.ppo_epochs x algo.minibatches`` **optimizer steps**. The data cursor, evaluation and checkpoint
cadence and the ``step`` of every metrics record count RL steps; the LR schedule counts applied optimizer
steps (a step skipped for a non-finite gradient does not advance it, and is counted apart).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Counters:
    """RL steps finished and optimizer steps applied / skipped since the run started (resumes included)."""

    rl_steps: int = 0
    optimizer_steps: int = 0
    skipped_updates: int = 0

    def state_dict(self) -> dict:
        return {
            "rl_steps": self.rl_steps,
            "optimizer_steps": self.optimizer_steps,
            "skipped_updates": self.skipped_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.rl_steps = int(state["rl_steps"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_updates = int(state["skipped_updates"])


class RNGStates:
    """Python, NumPy, torch (and CUDA) generators and megatron's model-parallel RNG tracker of this rank."""

    def state_dict(self) -> dict:
        from megatron.core import tensor_parallel

        name, keys, position, has_gauss, gauss = np.random.get_state()
        return {
            "python": random.getstate(),
            "numpy": [name, torch.from_numpy(keys.copy()), int(position), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }

    def load_state_dict(self, state: dict) -> None:
        from megatron.core import tensor_parallel

        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        name, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy(), position, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


@dataclass
class RunState:
    """What a checkpoint saves and a resume restores. ``train_state`` (models.optim.TrainState) is the sharded
    part; ``shared`` and ``per_rank`` map a name to a stateful object."""

    train_state: object
    shared: dict = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict)

    @property
    def counters(self) -> Counters:
        return self.shared["counters"]

    def shared_state(self) -> dict:
        return {name: part.state_dict() for name, part in self.shared.items()}

    def rank_state(self) -> dict:
        return {name: part.state_dict() for name, part in self.per_rank.items()}

    def load_shared(self, state: dict, source: str) -> None:
        _load_parts(self.shared, _legacy_shared(state), source)

    def load_rank(self, state: dict, source: str) -> None:
        _load_parts(self.per_rank, state, source)


def _load_parts(parts: dict, state: dict, source: str) -> None:
    missing = [name for name in parts if name not in state]
    if missing:
        raise ValueError(f"{source} has no {', '.join(missing)} (it holds {', '.join(sorted(state)) or 'nothing'})")
    for name, part in parts.items():
        part.load_state_dict(state[name])


def _legacy_shared(state: dict) -> dict:
    """Checkpoints written before the two counters: ``step`` was the RL step; the LR schedule's position is the
    number of applied optimizer steps."""
    if "counters" in state or "step" not in state:
        return state
    scheduler = state.get("scheduler", {})
    return {
        **state,
        "counters": {
            "rl_steps": int(state["step"]),
            "optimizer_steps": int(scheduler.get("num_steps", 0)),
            "skipped_updates": 0,
        },
    }
