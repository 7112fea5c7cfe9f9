"""The rollout engine a training run uses (``rollout.engine``): the embedded one, or SGLang / vLLM servers
behind :class:`megatron_kl.rollout.remote.DistributedEngine`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_kl.models import hf, output_head, parallel
from megatron_kl.rollout.engine import RolloutEngine
from megatron_kl.rollout.local import LocalEngine
from megatron_kl.train.config import TrainConfig


def _initial_model_path(cfg: TrainConfig, chunks: list, hf_source, run_dir: Path, configured) -> str | None:
    """Where managed servers start from: the configured path, the init HF checkpoint, or (collective) an HF
    export of the initial policy under the run directory."""
    if configured:
        return configured
    if hf_source is not None:
        return str(hf_source.path)
    out = hf.export_hf([output_head.unwrap(c) for c in chunks], cfg.model, run_dir / "weight_sync" / "initial",
                       dtype=cfg.model.params_dtype, tp_group=parallel.tp_group(), pp_group=parallel.pp_group())
    return str(out) if out is not None else None


def build_engine(cfg: TrainConfig, chunks: list, hf_source, run_dir: Path, dp_rank: int) -> RolloutEngine:
    engine = cfg.rollout.engine
    if engine == "local":  # synchronous: the replica shares the policy's tensors (no second copy of the weights)
        return LocalEngine(cfg.model, cfg.parallel, cfg.rollout.max_batch_size,
                           share_policy_weights=cfg.train.staleness == 0, flash_decode=cfg.rollout.flash_decode,
                           interruptible=cfg.rollout.partial, quantization=cfg.rollout.quantization,
                           delta_sync=cfg.rollout.delta_sync, delta_check_interval=cfg.rollout.delta_check_interval)
    from megatron_kl.rollout.remote import DistributedEngine

    source_dir = hf_source.path if hf_source is not None else None
    if engine == "sglang":
        sglang = cfg.rollout.sglang
        if sglang.sync_dir is None:
            sglang = dataclasses.replace(sglang, sync_dir=str(run_dir / "weight_sync"))
        model_path = None if sglang.urls else _initial_model_path(cfg, chunks, hf_source, run_dir, sglang.model_path)

        def make():
            from megatron_kl.rollout.sglang import RoutingShape, SGLangEngine
            from megatron_kl.rollout.weight_sync import build_weight_sync

            routing = RoutingShape.of(cfg.model) if cfg.model.moe.routing_replay == "rollout" else None
            from megatron_kl.rollout.delta import DeltaTracker

            delta = DeltaTracker(cfg.rollout.delta_check_interval) if cfg.rollout.delta_sync else None
            return SGLangEngine(sglang, build_weight_sync(sglang, cfg.model, source_dir, delta), model_path,
                                log_dir=run_dir / "sglang", seed=cfg.train.seed, vocab_size=cfg.model.vocab_size,
                                routing=routing, quantization=cfg.rollout.quantization, partial=cfg.rollout.partial)

        return DistributedEngine(make, cfg.model, dp_rank, parallel.tp_group(), parallel.pp_group(),
                                 timeout_s=cfg.parallel.distributed_timeout_s)
    vllm = cfg.rollout.vllm
    if vllm.sync_dir is None:
        vllm = dataclasses.replace(vllm, sync_dir=str(run_dir / "weight_sync"))
    model_path = _initial_model_path(cfg, chunks, hf_source, run_dir, vllm.model_path)

    def make_vllm():
        from megatron_kl.rollout.delta import DeltaTracker
        from megatron_kl.rollout.vllm import VLLMEngine

        delta = DeltaTracker(cfg.rollout.delta_check_interval) if cfg.rollout.delta_sync else None
        return VLLMEngine(vllm, cfg.model, model_path, seed=cfg.train.seed, source_dir=source_dir,
                          quantization=cfg.rollout.quantization, interruptible=cfg.rollout.partial, delta=delta)

    return DistributedEngine(make_vllm, cfg.model, dp_rank, parallel.tp_group(), parallel.pp_group(),
                             include_tied_head=True, timeout_s=cfg.parallel.distributed_timeout_s)
