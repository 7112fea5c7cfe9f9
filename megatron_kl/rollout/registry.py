"""Rollout engines by name (``rollout.engine``): what each one is, can do and needs, in one typed entry.

An :class:`EngineSpec` holds the builder and everything the rest of the trainer asks of an engine: whether it reports
its mixture-of-experts routing (``model.moe.routing_replay=rollout``), whether it can pause a generation
(``rollout.partial``), which training layouts it can serve, its served section's request limits, the cross-field
rules of its configuration, and (for a server a Slurm job starts beside the trainer) the one builder of its command
line. The trainer's rules ask these flags instead of naming engines (the one exception: the partial-rollout refusal
names vLLM's server mode, and the disaggregated Slurm job is SGLang's).

The built-ins (``local``, ``sglang``, ``vllm``) are registered in :mod:`megatron_kl.rollout.builtin_engines`. A new
engine is one module with a spec and ``ENGINES.register(spec)``, or a spec named in YAML as
``rollout.engine: package.module:SPEC`` (docs/extending.md). An engine from outside the package takes its settings
from ``rollout.options`` (a mapping, read into the spec's ``options`` dataclass and checked like any section).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_kl.registry import Registry


@dataclass(frozen=True)
class EngineContext:
    """What a builder gets: the resolved training config, the policy's model chunks on this rank (a served engine
    exports its initial weights from them), the HF checkpoint the run starts from (``init.hf_checkpoint``, or None),
    the run directory, this rank's data-parallel index, and the engine's options (``rollout.options`` read into
    ``EngineSpec.options``; None when the spec declares none)."""

    cfg: Any  # megatron_kl.train.config.TrainConfig
    chunks: list
    hf_source: Any
    run_dir: Path
    dp_rank: int
    options: Any = None


def _never(cfg) -> bool:
    return False


@dataclass(frozen=True)
class ServedLimits:
    """A served engine's request budget, checked against ``parallel.distributed_timeout_s`` (a dead server is then
    reported by the HTTP client, never by a collective timing out on another rank)."""

    section: str  # rollout.sglang
    max_retries: int
    backoff_s: float
    request_timeout_s: float
    startup_timeout_s: Optional[float] = None


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine. ``build(context) -> RolloutEngine`` (megatron_kl.rollout.engine): an engine whose
    ``update_weights`` takes the policy's model chunks; a served engine is wrapped in
    :class:`megatron_kl.rollout.distributed.DistributedEngine`, which gathers them into HF-named tensors."""

    name: str
    build: Callable[[EngineContext], Any]
    description: str = ""
    # completions carry ``routed_experts`` (the experts each token was routed to): model.moe.routing_replay=rollout
    reports_routing: bool = False
    # rollout.partial: the engine can pause a generation and return the partial response (a function of the config:
    # vLLM can in server mode only)
    can_pause: Callable[[Any], bool] = _never
    # training layouts whose policy the engine can sample from (the embedded engine reuses the training layout)
    pipeline_parallel: bool = True
    context_parallel: bool = True
    # a served engine's request budget (None: in process, no deadlines)
    limits: Optional[Callable[[Any], ServedLimits]] = None
    # cross-field rules on the resolved config, each raising ConfigError naming the field and the fix
    checks: tuple[Callable[[Any], None], ...] = ()
    # the config section holding the engine's settings (``rollout.sglang``); None for an engine from outside the
    # package, whose settings come from ``rollout.options`` read into ``options`` (a dataclass)
    section: Optional[str] = None
    options: Optional[type] = None
    # servers a Slurm job starts beside the trainer (launch.rollout_servers.mode=disaggregated): their command-line
    # flags from the training config, the same builder the engine's managed servers use
    server_flags: Optional[Callable[[Any], list[str]]] = None


ENGINES: Registry[EngineSpec] = Registry("rollout engine", EngineSpec, builtins="megatron_kl.rollout.builtin_engines")


def register_engine(spec: EngineSpec, *, replace: bool = False) -> EngineSpec:
    """Make ``rollout.engine: <spec.name>`` build this engine (see :class:`EngineSpec`)."""
    return ENGINES.register(spec, replace=replace)
