"""What a reward function is given and what it returns.

A reward function in ``sample`` mode is called once per response::

    def my_reward(sample: RewardInput, **kwargs) -> float | RewardResult

and in ``batch`` mode once per step with every response of the step (``list[RewardInput]`` in, a list of the same
length out). ``kwargs`` are ``reward.functions[i].kwargs`` from the config. A :class:`RewardResult` carries named
extra values that are logged as metrics (``reward/extra/<name>``, their mean over the step's samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class RewardInput:
    """One response to score.

    ``prompt``: the prompt as the data gave it (the question, before any chat template); ``response``: the response
    decoded without special tokens; ``answer``: the row's reference answer ("" when the data has none); ``fields``: the
    row's other columns, passed through; ``finish_reason``: ``stop`` (a stop token) or ``length`` (cut at the limit);
    ``index``: the sample's position in the step's batch; ``group``: the index of its prompt in the batch (the samples
    of one prompt share it)."""

    prompt: str
    response: str
    answer: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    fields: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: str = "stop"
    index: int = 0
    group: int = 0

    def to_json(self) -> dict:
        """The sample as a verifier service receives it."""
        return {
            "prompt": self.prompt,
            "response": self.response,
            "answer": self.answer,
            "fields": dict(self.fields),
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "finish_reason": self.finish_reason,
        }


@dataclass(frozen=True)
class RewardResult:
    """A reward with named extra values (each logged as ``reward/extra/<name>``, averaged over the step)."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


class InvalidReward(ValueError):
    """A function's return value is not a finite reward."""


def as_result(value: Any) -> RewardResult:
    """A function's return value as a RewardResult: a real number (int, float, a 0-d numpy / torch value), a
    RewardResult, or a mapping ``{"reward": r, "metrics": {...}}`` (a service's answer); anything else, NaN or an
    infinity is :class:`InvalidReward` naming what came back."""
    if isinstance(value, RewardResult):
        reward, metrics = value.reward, dict(value.metrics)
    elif isinstance(value, Mapping) and "reward" in value:
        reward, metrics = value["reward"], value.get("metrics") or {}
        if not isinstance(metrics, Mapping):
            raise InvalidReward(f"metrics {metrics!r} is not a mapping of names to numbers")
    else:
        reward, metrics = value, {}
    reward = _number(reward, "reward")
    return RewardResult(reward, {str(k): _number(v, f"metric {k!r}") for k, v in metrics.items()})


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or value is None or isinstance(value, (str, bytes)):
        raise InvalidReward(f"{what} {value!r} is not a number")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise InvalidReward(f"{what} {str(value)[:80]!r} (a {type(value).__name__}) is not a number") from None
    if not math.isfinite(out):
        raise InvalidReward(f"{what} {out} is not finite")
    return out
