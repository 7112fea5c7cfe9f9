"""The training job's typed config: one nested dataclass, YAML + dotted overrides, validated up front.

``load_train_config("configs/cpu/default.yaml", ["kl.estimator=k3", "train.steps=5"])`` builds it;
the rules between its sections are in :mod:`megatron_kl.train.checks` (``check_sections`` when it is built,
``validate_train_config`` before any process group or model exists).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_kl.algo.config import AlgoConfig
from megatron_kl.config import ConfigError, ModelConfig, ParallelConfig, load_yaml, to_dict
from megatron_kl.config.launch import LaunchConfig
from megatron_kl.constraints import DERIVED, SEED_MAX, check_declared, checked
from megatron_kl.distill.config import DistillConfig
from megatron_kl.kl.config import AUTO, KLConfig, Verdict
from megatron_kl.models.optim_config import OptimConfig
from megatron_kl.rewards.config import RewardConfig
from megatron_kl.rollout.config import QUANTIZATIONS, SamplingConfig, SGLangConfig, VLLMConfig
from megatron_kl.rollout.registry import ENGINES
from megatron_kl.run.host_malloc import MODES as HOST_MALLOC_MODES
from megatron_kl.run.identity_fields import identity_fields, resumable_prefixes
from megatron_kl.tasks.base import TaskConfig
from megatron_kl.train.checks import check_sections


@dataclass(frozen=True)
class RolloutConfig:
    # a registered engine (megatron_kl.rollout.registry: local, sglang, vllm) or package.module:SPEC
    engine: str = checked("local", choices=ENGINES)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_batch_size: int = checked(256, ge=1)  # sequences per engine forward
    # local engine: megatron's flash-decoding mode (each new key rotated once and cached rotated; a float32 cache for
    # 16-bit models on the CPU) instead of its static decode (keys cached before RoPE, every one re-rotated per step);
    # the same tokens and log-probs (tested)
    flash_decode: bool = True
    # asynchronous rollouts (train.staleness > 0): a weight update pauses the generations in flight instead of
    # waiting for them; their partial responses continue from prompt + partial response with the new weights, each
    # token keeping the version (and behaviour log-prob) of the weights that sampled it
    partial: bool = False
    # fp8: the engines sample with block-wise float8_e4m3 linear weights (SGLang / vLLM started with their FP8 option,
    # the embedded engine quantizing its copy after every sync); the trainer keeps its own weights, so mu is the FP8
    # policy's (mismatch/* show the gap; algo.behavior_correction corrects it)
    quantization: str = checked("none", choices=QUANTIZATIONS)
    # after a full first sync, send only what changed since the version the engine holds (changed elements, or
    # tensors whole where the route loads dense tensors); every delta_check_interval syncs all tensors' checksums
    # are compared; a mismatch, a restart or a version gap falls back to a full sync (rollout/delta.py)
    delta_sync: bool = False
    delta_check_interval: int = checked(10, ge=1)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    # the settings of an engine from outside the package, read into its spec's ``options`` dataclass
    options: dict[str, Any] = field(default_factory=dict)


WARM_START_SOURCES = ("auto", "shipped", "train")


@dataclass(frozen=True)
class WarmStartConfig:
    """A short supervised phase on the task's reference answers; its result (cached on disk, keyed by
    the model/task/warm-start config) initialises both the policy and the reference."""

    enabled: bool = True
    steps: int = checked(200, ge=0)
    batch_size: int = checked(64, ge=1)
    lr: float = checked(3e-3, gt=0)
    cache_dir: str = checked("runs/cache", resumable=True, path="writable")
    checkpoint: Optional[str] = checked(None, path="file")  # a full-state .pt to start from instead of training one
    # seed of the warm start's init and data order; null: train.seed. Fix it to share one starting model
    # (and reference) across the RL seeds of a study.
    seed: Optional[int] = checked(None, ge=0, le=SEED_MAX)
    # where the weights come from: auto = the package's shipped warm start when this recipe has one (the same
    # model on every machine; megatron_kl/data/warm_starts), else trained and cached; shipped = require it;
    # train = always train (float32 rounding makes the result machine-dependent)
    source: str = checked("auto", choices=WARM_START_SOURCES)

    def __post_init__(self):
        if self.source == "shipped" and (not self.enabled or self.checkpoint):
            other = (
                "warm_start.enabled=false skips the warm start"
                if not self.enabled
                else f"warm_start.checkpoint={self.checkpoint} starts from that file instead"
            )
            raise ConfigError(
                f"warm_start.source=shipped requires the package's warm start, but {other}: keep one "
                "(warm_start.source=auto leaves the choice to the other setting)"
            )


@dataclass(frozen=True)
class InitConfig:
    """Where policy and reference start. ``hf_checkpoint``: an HF model directory (Llama-3.x / Qwen2 / Qwen3
    safetensors) streamed into both models at train start; the model section must match its config.json
    (a mismatch is an error naming the fields) and the warm start is skipped. None: warm start / random."""

    hf_checkpoint: Optional[str] = checked(None, path="dir")


@dataclass(frozen=True)
class LoopConfig:
    """The ``train:`` section: the RL loop - steps, batch shape, staleness, seed, output directory, stop handling."""

    steps: int = checked(40, resumable=True, ge=1)
    prompts_per_step: int = checked(16, ge=1)
    group_size: int = checked(8, ge=1)  # samples per prompt
    micro_batches: int = checked(1, ge=1)  # pipeline microbatches per optimizer minibatch
    # > 0: microbatches by a token budget instead (verl's use_dynamic_bsz, slime's max_tokens_per_gpu): rows sorted
    # by length, packed greedily into microbatches of at most this many padded tokens, each padded only to its
    # own longest row; activation memory then follows the budget, not the batch (0: train.micro_batches slices)
    micro_batch_tokens: int = checked(0, ge=0)
    # auto: on a CPU-only process, glibc malloc keeps blocks < 32 MiB and up to 1 GiB of freed memory for reuse
    # instead of page-faulting them anew every step (run/host_malloc.py, measured); off: glibc's defaults
    host_malloc: str = checked("auto", resumable=True, choices=HOST_MALLOC_MODES)
    staleness: int = checked(
        0, ge=0
    )  # async bound s: rollouts of step t come from weights of step t - s (0: on-policy)
    max_consecutive_skips: int = checked(
        3, resumable=True, ge=0
    )  # optimizer steps with a NaN/inf gradient skipped in a row before the run stops
    # metric-only reference work every N steps (1: every step, the default; the other metrics are identical
    # either way): without a term that uses the reference (kl.coef=0 with PPO) its whole forward (kl/*); with
    # a sampled KL estimator (k1/k2/k3, RPG) the exact full-vocabulary KL (kl/exact_*), which no term reads
    reference_metrics_interval: int = checked(1, resumable=True, ge=1)
    seed: int = checked(1234, ge=0, le=SEED_MAX)  # numpy's generator takes seeds below 2^32
    # where the run writes; "{run_name}" is replaced by the run's name (estimator, placement, level, coefficient,
    # loss, staleness, seed), so a changed configuration lands in a directory of its own
    output_dir: str = checked("runs/{run_name}", resumable=True, path="writable")
    # signals that end the run with a checkpoint of the finished steps (a rollout in flight is cut off) and exit
    # code 75 (requeue + resume), 130 for SIGINT: SIGUSR1 is what the Slurm scripts request ahead of the time
    # limit, SIGTERM comes with preemption/scancel, SIGINT with Ctrl-C, SIGHUP with a closed terminal
    stop_signals: list[str] = checked(
        resumable=True, default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP"]
    )

    def __post_init__(self):
        from megatron_kl.run.preemption import check_signal_names

        object.__setattr__(self, "stop_signals", check_signal_names(self.stop_signals))
        if str(self.host_malloc).lower() in ("false", "off"):  # YAML 1.1 reads a bare `off` as false
            object.__setattr__(self, "host_malloc", "off")
        check_declared(self, "train.")
        if self.micro_batch_tokens > 0 and self.micro_batches != 1:
            raise ConfigError(
                f"train.micro_batch_tokens={self.micro_batch_tokens} and train.micro_batches="
                f"{self.micro_batches}: set one of them (the token budget decides the microbatches; "
                "leave train.micro_batches at 1)"
            )


@dataclass(frozen=True)
class EvalConfig:
    interval: int = checked(10, ge=0)  # steps between evaluations (0: only before and after training)
    k: int = checked(4, ge=1)  # samples per problem for mean@k
    temperature: float = checked(1.0, gt=0)  # for mean@k; pass@1 is greedy
    max_new_tokens: Optional[int] = checked(None, ge=1)  # default: rollout.sampling.max_new_tokens

    def __post_init__(self):
        check_declared(self, "eval.")


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = checked(10, ge=0)  # steps between checkpoints (0: only at the end)
    resume: bool = True  # continue from the latest checkpoint in train.output_dir when there is one
    keep: int = checked(2, ge=1)
    # a checkpoint that would not fit on the disk (about the size of the previous one): true deletes this run's
    # older checkpoints first, oldest first, always keeping the newest; false stops the run saying so
    free_before_write: bool = False
    export_hf: bool = False  # also write the policy as an HF checkpoint (step_XXXXXX/hf) at each checkpoint

    def __post_init__(self):
        check_declared(self, "checkpoint.")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    # Weights & Biases (pip install 'megatron-kl[wandb]'): the project turns it on; the W&B run is named after the run,
    # keyed by its run id (a resumed run continues it), with the resolved config (secrets redacted) uploaded
    wandb_project: Optional[str] = checked(None, free=True)
    wandb_entity: Optional[str] = checked(None, free=True)  # the team or user (default: W&B's default entity)
    wandb_tags: list[str] = field(default_factory=list)
    # online; offline (written under <output_dir>/wandb, `wandb sync` later: clusters without internet); disabled
    wandb_mode: str = checked("online", choices=("online", "offline", "disabled"))
    # a progress bar on a terminal; elsewhere (a Slurm log, a file) one line every progress_every steps and at least
    # every progress_every_s seconds (0: no time rule), with the reward, the KL terms, step time, tokens/s, remaining
    progress: bool = True
    progress_every: int = checked(1, ge=1)
    progress_every_s: float = checked(0.0, ge=0)
    # RL steps (0-based, as in metrics.jsonl) run under torch.profiler: Chrome trace, op table and a per-phase
    # GEMM / op-time summary in <output_dir>/profile/ (train/profiling.py); [] = none
    profile_steps: list[int] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.profile_steps, int) and not isinstance(self.profile_steps, bool):
            object.__setattr__(self, "profile_steps", [self.profile_steps])  # logging.profile_steps=3: that step
        if not isinstance(self.profile_steps, (list, tuple)):
            raise ConfigError(
                f"logging.profile_steps={self.profile_steps!r} must be a list of 0-based steps, "
                "e.g. logging.profile_steps=[2,10]"
            )
        bad = [s for s in self.profile_steps if not isinstance(s, int) or isinstance(s, bool) or s < 0]
        if bad:
            raise ConfigError(
                f"logging.profile_steps={self.profile_steps}: {bad} not a step index; list 0-based "
                "steps (integers >= 0), e.g. logging.profile_steps=[2,10]"
            )


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation from a teacher
    init: InitConfig = field(default_factory=InitConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    eval: EvalConfig = checked(resumable=True, default_factory=EvalConfig)
    checkpoint: CheckpointConfig = checked(resumable=True, default_factory=CheckpointConfig)
    logging: LoggingConfig = checked(resumable=True, default_factory=LoggingConfig)
    launch: LaunchConfig = checked(resumable=True, default_factory=LaunchConfig)  # read by `megatron-kl launch` only
    # resolved at load (:func:`resolve`), never given: what kl.estimator=auto chose (the exact audit's verdict -
    # configuration, bias, variance - for kl.target in the run's regime; kl itself then holds the chosen axes)
    kl_selection: Optional[Verdict] = field(default=None, compare=False, metadata={DERIVED: True})
    distill_selection: Optional[Verdict] = field(
        default=None, compare=False, metadata={DERIVED: True}
    )  # distill.kl.estimator=auto

    def __post_init__(self):
        check_sections(self)

    @classmethod
    def __resolve__(cls, cfg: "TrainConfig") -> "TrainConfig":
        """What loading a config does once it is built (``config.from_dict``): :func:`resolve`."""
        return resolve(cfg)

    @functools.cached_property
    def _run_key(self) -> str:
        return run_key(self)

    def with_sections(self, **sections) -> "TrainConfig":
        """A copy with whole sections replaced (``model=...``), not resolved again: what loading resolved - the
        ``kl.estimator=auto`` choice, ``{run_name}``, the Dr. GRPO length, the run key - is kept as it is."""
        out = copy.copy(self)
        for name, value in sections.items():
            object.__setattr__(out, name, value)
        return out

    @property
    def run_name(self) -> str:
        """The axes the estimator study varies, spelled out, then the run key (:func:`run_key`): two configurations
        that differ in any field of the run's identity have different names."""
        name = _run_name(self.kl, self.algo, self.train, self.distill)
        return f"{name}-{self._run_key}" if self._run_key else name


def _run_name(kl, algo, train, distill: Optional[DistillConfig] = None) -> str:
    teacher = f"{distill.name}-coef{distill.kl.coef:g}-" if distill is not None and distill.enabled else ""
    return f"{teacher}{kl.name}-coef{kl.coef:g}-{algo.name}-s{train.staleness}-seed{train.seed}"


def _selection_inputs(cfg):
    """What ``estimator=auto`` is judged under: the regime function and the behaviour correction."""
    from megatron_kl.kl.audit.targets import regime_of
    from megatron_kl.kl.corrections import correction_of

    return (lambda kl: regime_of(kl, cfg.train.staleness)), correction_of(cfg.algo)


def _select(kl: KLConfig, regime_of_term, correction, where: str):
    """``<where>.estimator=auto`` resolved to the audit's choice for its target: (the chosen KLConfig, the verdict)."""
    from megatron_kl.kl.audit.targets import select

    try:
        chosen, verdict, _ = select(kl, regime_of_term(kl), correction)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from err
    return chosen, verdict


def resolve(cfg: TrainConfig, fill_output_dir: bool = True) -> TrainConfig:
    """The configuration a run uses, built from the one given (loading resolves: ``from_dict``, ``load_train_config``,
    ``api.load_config``): ``kl.estimator=auto`` (and ``distill.kl``'s) replaced by the configuration the exact audit
    picks for its target (the verdict kept in ``kl_selection``); one fixed length for the Dr. GRPO aggregation of the
    policy loss, the KL term and RPG's (algo.norm_length, by default rollout.sampling.max_new_tokens); then
    ``{run_name}`` filled in ``train.output_dir``. Resolving a resolved configuration returns it unchanged."""
    regime_of_term, correction = _selection_inputs(cfg)
    kl, kl_selection = cfg.kl, cfg.kl_selection
    if kl.estimator == AUTO:
        kl, kl_selection = _select(kl, regime_of_term, correction, "kl")
    objective, distill_selection = cfg.distill.kl, cfg.distill_selection
    if objective.estimator == AUTO and cfg.distill.enabled:
        objective, distill_selection = _select(objective, regime_of_term, correction, "distill.kl")
    length = cfg.algo.norm_length or cfg.rollout.sampling.max_new_tokens
    rpg = (
        cfg.algo.rpg if cfg.algo.rpg.norm_length is not None else dataclasses.replace(cfg.algo.rpg, norm_length=length)
    )
    if kl.norm_length is None:
        kl = dataclasses.replace(kl, norm_length=length)
    if objective.norm_length is None and cfg.distill.enabled:  # off: the section stays as given (the run key)
        objective = dataclasses.replace(objective, norm_length=length)
    out = dataclasses.replace(
        cfg,
        kl=kl,
        algo=dataclasses.replace(cfg.algo, norm_length=length, rpg=rpg),
        distill=dataclasses.replace(cfg.distill, kl=objective),
        kl_selection=kl_selection,
        distill_selection=distill_selection,
    )
    if not fill_output_dir:
        return out
    if "{run_name}" in out.train.output_dir:  # the run key of the resolved configuration
        out = dataclasses.replace(
            out,
            train=dataclasses.replace(out.train, output_dir=out.train.output_dir.replace("{run_name}", out.run_name)),
        )
    out._run_key  # noqa: B018 - the key of the configuration as loaded, kept by with_sections' copies
    return out


@functools.lru_cache(maxsize=1)
def _default_fields() -> dict:
    """The identity fields of the default configuration, resolved."""
    return _key_fields(resolve(TrainConfig(), fill_output_dir=False))


def _key_fields(cfg) -> dict:
    return identity_fields(to_dict(cfg), resumable_prefixes(type(cfg)))


def run_key(cfg) -> str:
    """Six hex digits of the SHA-256 of the run-identity fields (run/identity.py: what decides the trajectory, not
    where it is written or how it is logged) whose values differ from the code's defaults, as sorted JSON. A field at
    its default is left out, so a field a later version adds does not change the key of an unchanged configuration;
    any other change does. "" for the default configuration."""
    defaults = _default_fields()
    changed = {k: v for k, v in _key_fields(resolve(cfg, False)).items() if k not in defaults or defaults[k] != v}
    if not changed:
        return ""
    return hashlib.sha256(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:6]


def load_train_config(path: str, overrides: Optional[list[str]] = None) -> TrainConfig:
    return load_yaml(path, TrainConfig, overrides)
