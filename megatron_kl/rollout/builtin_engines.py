"""The built-in rollout engines' entries: the embedded engine (``local``), SGLang servers and vLLM.

Each entry's rules are the engine's own cross-field rules (the trainer's general rules ask the entry's flags); each
builder imports its engine when a run builds it, so checking a config imports no serving code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_kl.constraints import ConfigError
from megatron_kl.rollout.config import DELTA_LOADER
from megatron_kl.rollout.registry import EngineContext, EngineSpec, ServedLimits, register_engine


def initial_model_path(ctx: EngineContext, configured) -> str | None:
    """Where managed servers start from: the configured path, the init HF checkpoint, or (collective) an HF
    export of the initial policy under the run directory."""
    from megatron_kl.models import hf, output_head, parallel

    if configured:
        return configured
    if ctx.hf_source is not None:
        return str(ctx.hf_source.path)
    cfg = ctx.cfg
    out = hf.export_hf(
        [output_head.unwrap(c) for c in ctx.chunks],
        cfg.model,
        Path(ctx.run_dir) / "weight_sync" / "initial",
        dtype=cfg.model.params_dtype,
        tp_group=parallel.tp_group(),
        pp_group=parallel.pp_group(),
    )
    return str(out) if out is not None else None


def _delta_tracker(cfg):
    from megatron_kl.rollout.delta import DeltaTracker

    return DeltaTracker(cfg.rollout.delta_check_interval) if cfg.rollout.delta_sync else None


def _distributed(ctx: EngineContext, make, include_tied_head: bool = False):
    from megatron_kl.models import parallel
    from megatron_kl.rollout.distributed import DistributedEngine

    cfg = ctx.cfg
    return DistributedEngine(
        make,
        cfg.model,
        ctx.dp_rank,
        parallel.tp_group(),
        parallel.pp_group(),
        include_tied_head=include_tied_head,
        timeout_s=cfg.parallel.distributed_timeout_s,
    )


# -- local: the embedded megatron-core engine ------------------------------------------------------------------------
def build_local(ctx: EngineContext):
    """Synchronous runs share the policy's tensors (no second copy of the weights)."""
    from megatron_kl.rollout.local import LocalEngine

    cfg = ctx.cfg
    rollout = cfg.rollout
    return LocalEngine(
        cfg.model,
        cfg.parallel,
        rollout.max_batch_size,
        share_policy_weights=cfg.train.staleness == 0,
        flash_decode=rollout.flash_decode,
        interruptible=rollout.partial,
        quantization=rollout.quantization,
        delta_sync=rollout.delta_sync,
        delta_check_interval=rollout.delta_check_interval,
    )


def _local_rules(cfg) -> None:
    if cfg.rollout.delta_sync and cfg.rollout.quantization == "fp8":
        raise ConfigError(
            "rollout.delta_sync=true with rollout.engine=local and rollout.quantization=fp8: the embedded "
            "engine's FP8 replica is requantized whole at every sync (nothing to send in deltas); set "
            "rollout.delta_sync=false, or use rollout.engine=sglang"
        )


LOCAL = EngineSpec(
    name="local",
    build=build_local,
    description="the embedded megatron-core engine, in the trainer's processes",
    reports_routing=True,
    can_pause=lambda cfg: True,
    pipeline_parallel=False,
    context_parallel=False,
    checks=(_local_rules,),
)


# -- sglang: SGLang HTTP servers (managed, given by URL, or a Slurm job's disaggregated group) -----------------------
def build_sglang(ctx: EngineContext):
    cfg, run_dir = ctx.cfg, Path(ctx.run_dir)
    sglang = cfg.rollout.sglang
    if sglang.sync_dir is None:
        sglang = dataclasses.replace(sglang, sync_dir=str(run_dir / "weight_sync"))
    model_path = None if sglang.urls else initial_model_path(ctx, sglang.model_path)
    source_dir = ctx.hf_source.path if ctx.hf_source is not None else None

    def make():
        from megatron_kl.rollout.sglang import SGLangEngine
        from megatron_kl.rollout.sglang_protocol import RoutingShape
        from megatron_kl.rollout.sglang_sync import build_weight_sync

        routing = RoutingShape.of(cfg.model) if cfg.model.moe.routing_replay == "rollout" else None
        return SGLangEngine(
            sglang,
            build_weight_sync(sglang, cfg.model, source_dir, _delta_tracker(cfg)),
            model_path,
            log_dir=run_dir / "sglang",
            seed=cfg.train.seed,
            vocab_size=cfg.model.vocab_size,
            routing=routing,
            quantization=cfg.rollout.quantization,
            partial=cfg.rollout.partial,
        )

    return _distributed(ctx, make)


def _sglang_rules(cfg) -> None:
    if cfg.train.staleness > 0 and cfg.rollout.sglang.colocated:
        raise ConfigError(
            f"train.staleness={cfg.train.staleness} generates while the trainer runs, but "
            "rollout.sglang.colocated=true releases the servers' memory during training: set "
            "rollout.sglang.colocated=false (servers on GPUs of their own) or train.staleness=0"
        )


def sglang_server_flags(cfg) -> list[str]:
    """The flags of the servers a Slurm job starts beside the trainer (``launch.rollout_servers``): the managed
    servers' builder (``rollout/sglang.server_flags``) with the launch section's layout and every flag the training
    config implies (routing replay, FP8, the delta loader)."""
    from megatron_kl.rollout.sglang import server_flags

    servers = cfg.launch.rollout_servers
    delta = cfg.rollout.delta_sync and cfg.rollout.sglang.weight_sync == "from_tensor"
    return server_flags(
        servers.model_path or cfg.init.hf_checkpoint,
        "0.0.0.0",
        servers.port,
        servers.tp_size,
        max(1, servers.gpus_per_node // servers.tp_size),
        servers.mem_fraction_static,
        cfg.train.seed,
        routed_experts=cfg.model.moe.routing_replay == "rollout",
        quantization=cfg.rollout.quantization,
        weight_loaders=[DELTA_LOADER] if delta else [],
        extra_args=servers.extra_args,
    )


def _served_limits(section: str, startup: bool):
    def limits(cfg) -> ServedLimits:
        served = getattr(cfg.rollout, section)
        return ServedLimits(
            f"rollout.{section}",
            served.max_retries,
            served.backoff_s,
            served.request_timeout_s,
            served.startup_timeout_s if startup else None,
        )

    return limits


SGLANG = EngineSpec(
    name="sglang",
    build=build_sglang,
    description="SGLang HTTP servers (managed here, given by URL, or a Slurm group)",
    reports_routing=True,
    can_pause=lambda cfg: True,
    limits=_served_limits("sglang", startup=True),
    checks=(_sglang_rules,),
    section="rollout.sglang",
    server_flags=sglang_server_flags,
)


# -- vllm: vllm.LLM in the trainer process, or an OpenAI-compatible vLLM server --------------------------------------
def build_vllm(ctx: EngineContext):
    cfg = ctx.cfg
    vllm = cfg.rollout.vllm
    if vllm.sync_dir is None:
        vllm = dataclasses.replace(vllm, sync_dir=str(Path(ctx.run_dir) / "weight_sync"))
    model_path = initial_model_path(ctx, vllm.model_path)
    source_dir = ctx.hf_source.path if ctx.hf_source is not None else None

    def make():
        from megatron_kl.rollout.vllm import VLLMEngine

        return VLLMEngine(
            vllm,
            cfg.model,
            model_path,
            seed=cfg.train.seed,
            source_dir=source_dir,
            quantization=cfg.rollout.quantization,
            interruptible=cfg.rollout.partial,
            delta=_delta_tracker(cfg),
        )

    return _distributed(ctx, make, include_tied_head=True)


def _vllm_rules(cfg) -> None:
    rollout = cfg.rollout
    sampling, vllm = rollout.sampling, rollout.vllm
    if (
        vllm.mode == "server"
        and sampling.truncates(cfg.model.vocab_size)
        and vllm.server_logprobs_mode != "processed_logprobs"
    ):
        raise ConfigError(
            f"rollout.engine=vllm (mode=server) with rollout.sampling.top_k={sampling.top_k} / top_p={sampling.top_p}: "
            f"the server returns {vllm.server_logprobs_mode} (log-probs of the full softmax), not those of the truncated "
            "distribution it samples; start it with --logprobs-mode processed_logprobs and set "
            "rollout.vllm.server_logprobs_mode=processed_logprobs"
        )
    if cfg.train.staleness > 0 and vllm.enable_sleep_mode:
        raise ConfigError(
            f"train.staleness={cfg.train.staleness} generates while the trainer runs, but "
            "rollout.vllm.enable_sleep_mode=true puts vLLM to sleep during training: set it to false "
            "or train.staleness=0"
        )
    if rollout.quantization == "fp8" and vllm.mode == "server":
        raise ConfigError(
            "rollout.quantization=fp8 with rollout.vllm.mode=server: the client cannot see which "
            "weights a running vLLM server samples with; use rollout.vllm.mode=llm (started here with "
            "quantization=fp8) or rollout.engine=sglang / local"
        )
    if rollout.quantization == "fp8" and vllm.dtype in ("float", "float32"):
        raise ConfigError(
            f"rollout.quantization=fp8 with rollout.vllm.dtype={vllm.dtype}: vLLM's FP8 "
            "quantization takes bfloat16 or float16 weights; set rollout.vllm.dtype=bfloat16"
        )


VLLM = EngineSpec(
    name="vllm",
    build=build_vllm,
    description="vLLM: vllm.LLM in the trainer process, or a vLLM server",
    reports_routing=False,
    can_pause=lambda cfg: cfg.rollout.vllm.mode == "server",
    limits=_served_limits("vllm", startup=False),
    checks=(_vllm_rules,),
    section="rollout.vllm",
)

for _spec in (LOCAL, SGLANG, VLLM):
    register_engine(_spec)
