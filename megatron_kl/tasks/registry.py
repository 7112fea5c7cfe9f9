"""The built-in tasks' entries in :data:`megatron_kl.tasks.base.TASKS` and ``build_task``: the one module that knows
every built-in task (they import ``base``, ``base`` imports none of them)."""

from __future__ import annotations

from megatron_kl.config import from_dict
from megatron_kl.constraints import ConfigError
from megatron_kl.tasks.arithmetic import ArithmeticTask
from megatron_kl.tasks.base import TASKS, Task, TaskConfig, TaskSpec
from megatron_kl.tasks.dataset import DatasetTask, TaskContext
from megatron_kl.tasks.math import MathTask

for _spec in (
    TaskSpec(
        "arithmetic",
        lambda c, ctx, o: ArithmeticTask(c.arithmetic, seed=c.seed, eval_size=c.eval_size),
        "integer arithmetic generated from a seed (task.arithmetic)",
    ),
    TaskSpec(
        "math",
        lambda c, ctx, o: MathTask(c.math, seed=c.seed),
        "math word problems from JSONL files, answers checked by math-verify (task.math)",
    ),
    TaskSpec(
        "dataset",
        lambda c, ctx, o: DatasetTask(c.dataset, seed=c.seed, context=ctx),
        "your own JSONL / Parquet / HF dataset with your reward functions (task.dataset)",
    ),
):
    TASKS.register(_spec)


def build_task(config: TaskConfig, context: TaskContext = TaskContext()) -> Task:
    spec = TASKS.get(config.name, "task.name")
    if spec.options is None:
        if config.options:
            raise ConfigError(
                f"task.options={dict(config.options)!r}: task.name={config.name} takes its settings from "
                f"task.{config.name}, not task.options; remove task.options"
            )
        return spec.build(config, context, None)
    return spec.build(config, context, from_dict(spec.options, dict(config.options), prefix="task.options."))
