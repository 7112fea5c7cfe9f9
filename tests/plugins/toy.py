"""Extensions from outside the package, each one module-level spec a config names as ``tests.plugins.toy:NAME``:
a rollout engine (the embedded engine behind a counter, with options of its own), a KL estimator (d^2, twice k2),
a model family (Llama's layout with Qwen3's norms and a block seam that swaps the core attention for a counting one),
a task (additions only, its operators an option) and a reward function."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_kl.config import ModelFamily
from megatron_kl.kl.config import EstimatorSpec
from megatron_kl.rewards import RewardInput
from megatron_kl.rollout.builtin_engines import build_local
from megatron_kl.rollout.engine import EngineBase
from megatron_kl.rollout.registry import EngineSpec
from megatron_kl.tasks.arithmetic import ArithmeticTask
from megatron_kl.tasks.base import TaskSpec

CALLS = {"generate": 0, "prompts": 0, "attention": 0, "engine_options": None, "task_options": None}


# -- a rollout engine ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CountingOptions:
    label: str = "counted"


class CountingEngine(EngineBase):
    """The embedded engine, every generate call counted."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def weight_version(self):
        return self.inner.weight_version

    def generate(self, prompts, sampling, seed=None, budgets=None):
        CALLS["generate"] += 1
        CALLS["prompts"] += len(prompts)
        return self.inner.generate(prompts, sampling, seed=seed, budgets=budgets)

    def update_weights(self, source, version):
        self.inner.update_weights(source, version)

    @property
    def last_sync(self):
        return self.inner.last_sync

    def shutdown(self):
        self.inner.shutdown()


def _build_counting(ctx):
    CALLS["engine_options"] = ctx.options
    return CountingEngine(build_local(ctx))


ENGINE = EngineSpec(
    "counting",
    build=_build_counting,
    description="the embedded engine, counted",
    pipeline_parallel=False,
    context_parallel=False,
    options=CountingOptions,
)

# -- a KL estimator --------------------------------------------------------------------------------------------------
ESTIMATOR = EstimatorSpec("d_squared", value=lambda d: d.square(), description="d^2 (twice k2)")


# -- a model family --------------------------------------------------------------------------------------------------
class CountingAttention(DotProductAttention):
    def forward(self, *args, **kwargs):
        CALLS["attention"] += 1
        return super().forward(*args, **kwargs)


def _counting_attention(model, spec, dense):
    spec.submodules.self_attention.submodules.core_attention = CountingAttention
    return spec


FAMILY = ModelFamily(
    "toy_llama",
    {"qkv_bias": False, "qk_layernorm": True, "rope_theta": 10000.0},
    layer_spec=_counting_attention,
    description="Llama with Qwen3's q/k norms",
)


# -- a task ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SumsOptions:
    operators: str = "+"


def _build_sums(config, context, options: SumsOptions):
    CALLS["task_options"] = options
    arithmetic = dataclasses.replace(config.arithmetic, operators=options.operators, ood_operators=options.operators)
    return ArithmeticTask(arithmetic, seed=config.seed, eval_size=config.eval_size)


TASK = TaskSpec("sums", build=_build_sums, description="additions", options=SumsOptions)


# -- a reward --------------------------------------------------------------------------------------------------------
def starts_with_answer(sample: RewardInput, bonus: float = 0.0) -> float:
    """1 for a response that starts with the answer, plus ``bonus`` for every response."""
    return float(sample.response.strip().startswith(sample.answer)) + bonus
