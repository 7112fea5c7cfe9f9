"""The rollout engine a training run uses: ``rollout.engine`` looked up in the engine registry
(:mod:`megatron_kl.rollout.registry`) and built with this rank's context."""

from __future__ import annotations

from pathlib import Path

from megatron_kl.config import from_dict
from megatron_kl.rollout.engine import RolloutEngine
from megatron_kl.rollout.registry import ENGINES, EngineContext
from megatron_kl.train.config import TrainConfig


def engine_options(cfg: TrainConfig):
    """``rollout.options`` read into the engine's options dataclass (checked like a section); None when the engine
    declares none."""
    spec = ENGINES.get(cfg.rollout.engine, "rollout.engine")
    if spec.options is None:
        return None
    return from_dict(spec.options, dict(cfg.rollout.options), prefix="rollout.options.")


def build_engine(cfg: TrainConfig, chunks: list, hf_source, run_dir: Path, dp_rank: int) -> RolloutEngine:
    spec = ENGINES.get(cfg.rollout.engine, "rollout.engine")
    return spec.build(EngineContext(cfg, chunks, hf_source, Path(run_dir), dp_rank, engine_options(cfg)))
