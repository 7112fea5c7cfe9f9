"""The ``distill:`` section: on-policy distillation from a frozen teacher, a second KL term beside the reference's.

The student samples; the teacher scores every sampled sequence; the student minimises the reverse KL(student ||
teacher) on its own samples, estimated exactly over the vocabulary (``distill.kl.estimator=full``) or from the
sampled token (k1 / k2 / k3), in the loss or in the reward, at token or sequence level: the same axes, names and
math as the KL to the reference (``kl.*``, megatron_kl.kl.objective, docs/kl-math.md) with the teacher in the
reference's place. The audit judges each configuration for ``distill.kl.target`` (docs/distillation.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_kl.config import ConfigError, ModelConfig
from megatron_kl.constraints import SEED_MAX, checked
from megatron_kl.kl.config import AGGREGATIONS, AUTO, ESTIMATORS, LEVELS, PLACEMENTS, TOP_K, TopKConfig

TEACHER_SOURCES = ("warm_start", "hf", "checkpoint", "server")
TASK_REWARDS = ("keep", "none")
SERVER_APIS = ("sglang", "vllm")  # the teacher servers' HTTP API (megatron_kl.distill.served)


@dataclass(frozen=True)
class TeacherServer:
    """``distill.teacher.source: server``: SGLang or vLLM servers of the teacher (``api``; megatron_kl.distill.served),
    asked for its log-probs at the sampled tokens and its top-k per position (``distill.kl.top_k``); the API key, if
    the servers have one, from the environment variable ``api_key_env``."""

    urls: list[str] = field(default_factory=list)
    api: str = checked("sglang", choices=SERVER_APIS)  # sglang: /generate; vllm: /v1/completions prompt_logprobs
    api_key_env: str = checked("MEGATRON_KL_TEACHER_API_KEY", free=True, nonempty=True)
    max_concurrency: int = checked(32, ge=1)  # scoring requests in flight per data-parallel replica
    request_timeout_s: float = checked(300.0, ge=0.1)  # total per attempt
    max_retries: int = checked(4, ge=0)  # on 5xx / 429 / timeouts / dropped answers / impossible values
    backoff_s: float = checked(0.5, ge=0)  # first retry delay, doubled each retry

    def __post_init__(self):
        if not isinstance(self.urls, list) or not all(isinstance(u, str) and u.startswith("http") for u in self.urls):
            raise ConfigError(f"distill.teacher.server.urls={self.urls!r} must be a list of http(s):// addresses")


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher: a model with the student's vocabulary, of any supported architecture and size.

    - ``source=hf``: an HF model directory (``hf_checkpoint``); its config.json gives the architecture, and its
      vocabulary and tokenizer must be the student's;
    - ``source=checkpoint``: a full-state file (``checkpoint``, weights only) of the architecture ``model``;
    - ``source=warm_start``: the supervised warm start of ``model`` on the task for ``warm_start_steps`` steps (the
      package ships the CPU demonstration's teacher; otherwise trained once, with ``warm_start_seed``, and cached like
      the student's);
    - ``source=server``: SGLang servers of the teacher (``server``); its log-probs and top-k come over HTTP, so the
      exact KL is not available (``distill.kl.estimator`` topk or k1 / k2 / k3); ``hf_checkpoint``, if given, is the
      directory the servers serve, for the vocabulary and tokenizer check.
    ``tensor_parallel`` / ``pipeline_parallel``: the teacher's layout (null: the student's); other sizes than the
    student's run in a layout of its own (distill/layout.py)."""

    source: str = checked("warm_start", choices=TEACHER_SOURCES)
    hf_checkpoint: Optional[str] = checked(None, path="dir")
    checkpoint: Optional[str] = checked(None, path="file")
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start_steps: int = checked(2000, ge=1)
    warm_start_seed: int = checked(0, ge=0, le=SEED_MAX)  # one teacher for every RL seed of a study
    tensor_parallel: Optional[int] = checked(None, ge=1)
    pipeline_parallel: Optional[int] = checked(None, ge=1)
    offload: bool = False  # keep the teacher's weights in host memory between its passes (CUDA only)
    server: TeacherServer = field(default_factory=TeacherServer)

    def __post_init__(self):
        needs = {"hf": "hf_checkpoint", "checkpoint": "checkpoint"}.get(self.source)
        if needs and getattr(self, needs) is None:
            raise ConfigError(
                f"distill.teacher.source={self.source} needs distill.teacher.{needs}: give the "
                f"teacher's {'HF model directory' if needs == 'hf_checkpoint' else 'full-state file'}"
            )
        if (self.source == "server") != bool(self.server.urls):
            raise ConfigError(
                "distill.teacher.server.urls gives the teacher's servers and goes with "
                f"distill.teacher.source=server (now source={self.source}, urls={self.server.urls}): "
                "set both, or neither"
            )
        optional = ("hf_checkpoint",) if self.source == "server" else ()  # the served directory, for the checks
        for other in ("hf_checkpoint", "checkpoint"):
            if other != needs and other not in optional and getattr(self, other) is not None:
                raise ConfigError(
                    f"distill.teacher.{other}={getattr(self, other)} is unused with "
                    f"distill.teacher.source={self.source}: drop it or set the source that reads it"
                )


@dataclass(frozen=True)
class DistillObjective(TopKConfig):
    """The distillation term: a TopKConfig (every KLConfig axis with the same meaning, and the top-k approximation of a
    served teacher, ``estimator=topk``) whose defaults are the exact reverse KL in the loss at sequence level
    (Rao-Blackwellised: the unbiased gradient of the sequence-level KL(student || teacher) on-policy,
    docs/distillation.md), weight 1, averaged over tokens. A field left out of ``distill.kl`` keeps these defaults, not
    the reference term's."""

    estimator: str = checked("full", choices=ESTIMATORS.and_names(TOP_K, AUTO))
    placement: str = checked("loss", choices=PLACEMENTS)
    level: str = checked("sequence", choices=LEVELS)
    coef: float = checked(1.0, ge=0)
    aggregation: str = checked("token_mean", choices=AGGREGATIONS)


@dataclass(frozen=True)
class DistillConfig:
    """``enabled``: distil from ``teacher`` with the objective ``kl`` (a KLConfig: estimator, placement, level, credit,
    off_policy, coef, target; ``auto`` picks the audit's unbiased configuration for ``kl.target``). ``task_reward``:
    keep the task's reward beside the distillation term, or ``none`` (distillation alone: advantages zero)."""

    enabled: bool = False
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    kl: DistillObjective = field(default_factory=DistillObjective)
    task_reward: str = checked("keep", choices=TASK_REWARDS)

    @property
    def name(self) -> str:
        """``distill-<objective>`` for run names and logs (``distill-full-loss-sequence``), "" when off."""
        return f"distill-{self.kl.name}" if self.enabled else ""

    def objective(self) -> Optional[TopKConfig]:
        """The distillation term's KLConfig when distillation is on and weighted, else None."""
        return self.kl if self.enabled and self.kl.coef > 0 else None


def teacher_parallel(teacher: TeacherConfig, student_parallel):
    """The teacher's ParallelConfig: the student's with the teacher's tensor / pipeline sizes where given (no virtual
    pipeline, no sequence or context parallelism of its own: a frozen scorer of whole sequences)."""
    tp = teacher.tensor_parallel or student_parallel.tensor_parallel
    pp = teacher.pipeline_parallel or student_parallel.pipeline_parallel
    same = tp == student_parallel.tensor_parallel and pp == student_parallel.pipeline_parallel
    if same:
        return student_parallel
    return dataclasses.replace(
        student_parallel,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        virtual_pipeline=None,
        sequence_parallel=False,
        context_parallel=1,
        expert_parallel=1,
        expert_tensor_parallel=None,
    )
