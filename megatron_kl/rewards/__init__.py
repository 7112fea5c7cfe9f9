"""Reward functions: built-ins, your own by import path or registered from Python, verifier services over HTTP,
combined with weights and scored concurrently with a failure policy (docs/your-own-job.md).

    from megatron_kl.rewards import RewardInput, RewardResult, register

    @register("length_penalty")
    def length_penalty(sample: RewardInput, limit: int = 64) -> float:
        return -max(0, len(sample.response_ids) - limit) / limit
"""

from megatron_kl.rewards.config import RewardConfig, RewardFunctionConfig, RewardServiceConfig
from megatron_kl.rewards.registry import BUILTINS, register, unregister
from megatron_kl.rewards.types import RewardInput, RewardResult

__all__ = [
    "BUILTINS",
    "RewardConfig",
    "RewardFunctionConfig",
    "RewardInput",
    "RewardResult",
    "RewardServiceConfig",
    "register",
    "unregister",
]
