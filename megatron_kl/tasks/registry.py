"""``task.name`` -> the task class: the one module that knows every built-in task (they import ``base``,
``base`` imports none of them)."""

from __future__ import annotations

from megatron_kl.tasks.arithmetic import ArithmeticTask
from megatron_kl.tasks.base import Task, TaskConfig
from megatron_kl.tasks.dataset import DatasetTask, TaskContext
from megatron_kl.tasks.math import MathTask


def build_task(config: TaskConfig, context: TaskContext = TaskContext()) -> Task:
    if config.name == "arithmetic":
        return ArithmeticTask(config.arithmetic, seed=config.seed, eval_size=config.eval_size)
    if config.name == "dataset":
        return DatasetTask(config.dataset, seed=config.seed, context=context)
    return MathTask(config.math, seed=config.seed)
