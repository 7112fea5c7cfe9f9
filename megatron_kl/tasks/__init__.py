"""Tasks: prompts with verifiable answers, split into in-domain and out-of-distribution sets."""

from megatron_kl.tasks.base import Problem, Task, TaskConfig
from megatron_kl.tasks.registry import build_task

__all__ = ["Problem", "Task", "TaskConfig", "build_task"]
