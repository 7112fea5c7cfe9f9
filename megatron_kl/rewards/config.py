"""The ``reward:`` section: which reward functions score a response, how they are combined, how long a call may take,
what a failed call does, and the verifier / reward-model service they may call. Torch-free (``--check`` reads it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from megatron_kl.config import ConfigError
from megatron_kl.constraints import checked

FAILURE_POLICIES = ("fail", "exclude")


def metric_segment(name: str, limit: int | None = None) -> str:
    """A name as one segment of a metric key (letters, digits and ``_.-``; anything else becomes ``_``), cut to
    ``limit`` characters when given: ``reward/fn/<label>``, ``reward/extra/<name>``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:limit] or "_"


CALL_MODES = ("auto", "sample", "batch")


@dataclass(frozen=True)
class RewardFunctionConfig:
    """One reward term: ``name`` is a built-in (``arithmetic``, ``math_verify``, ``exact_match``, ``boxed_match``,
    ``regex_match``, ``service``, or one registered from Python with ``megatron_kl.rewards.register``), an import path
    ``package.module:function`` or a file ``path/to/file.py:function``. The total reward is the weighted sum."""

    # a built-in, a name registered from Python, 'package.module:function' or 'path/to/file.py:function'
    name: str = checked("", free=True, nonempty=True)
    weight: float = checked(1.0)  # its factor in the total reward (negative: a penalty)
    # sample: fn(sample, **kwargs) -> float | RewardResult, one call per response (run concurrently);
    # batch: fn(samples, **kwargs) -> list of them, one call per step's batch (a verifier cheaper in batches);
    # auto: the function's own (built-ins and registered functions know theirs; an imported one: sample)
    mode: str = checked("auto", choices=CALL_MODES)
    # keyword arguments given to the function at every call (regex_match: pattern; exact_match: ignore_case)
    kwargs: dict[str, Any] = field(default_factory=dict)
    # a label for the metrics (reward/fn/<label>); default: the function's name without its module path
    label: str = checked("", free=True)

    def __post_init__(self):
        if not self.name.strip():
            raise ValueError(
                "RewardFunctionConfig.name is empty: name a built-in, 'package.module:function' or "
                "'path/to/file.py:function'"
            )

    @property
    def metric_label(self) -> str:
        """The label as a metric key segment (:func:`metric_segment`)."""
        return metric_segment(self.label or self.name.rsplit(":", 1)[-1].rsplit(".", 1)[-1])


@dataclass(frozen=True)
class RewardServiceConfig:
    """A verifier or reward-model service over HTTP (the ``service`` built-in): ``POST <url><path>`` with
    ``{"samples": [{"prompt", "response", "answer", "fields", "prompt_ids", "response_ids"}, ...]}``, answered with
    ``{"rewards": [r, ...]}`` (each a number or ``{"reward": r, "metrics": {name: value}}``), one per sample in order.
    5xx / 429 answers, timeouts, dropped connections, bodies that are not JSON and answers with the wrong count are
    retried with exponential backoff; then the call has failed (``reward.on_failure`` decides)."""

    urls: list[str] = field(default_factory=list)  # several: batches are spread over them in turn
    path: str = checked("/score", free=True, nonempty=True)  # the scoring route on each URL
    timeout_s: float = checked(60.0, ge=0.1)  # total per attempt (headers and body)
    max_retries: int = checked(3, ge=0)  # attempts after the first, per request
    backoff_s: float = checked(0.5, ge=0)  # doubled after each failed attempt, up to 30 s
    batch_size: int = checked(32, ge=1)  # samples per request
    concurrency: int = checked(4, ge=1)  # requests in flight
    # before the first request, wait up to this long for every URL to answer at all (GET /health, any status): a
    # service started beside the trainer (launch.reward_service) may still be loading; 0: do not wait
    startup_timeout_s: float = checked(300.0, ge=0)
    # the name of an environment variable holding a bearer token sent as "Authorization: Bearer <token>"; the token is
    # read at start, never written to a log, config.yaml or the metrics ("" = no authentication)
    token_env: str = checked("", free=True)


@dataclass(frozen=True)
class RewardConfig:
    """How a response is scored. ``functions`` empty: the task's own reward (arithmetic: exact answer then EOS;
    math: math-verify on the final answer); a ``task.name=dataset`` job names its functions."""

    # the reward terms, summed with their weights; [] = the task's own reward
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    # what a failed call does - it raised, timed out, returned NaN/inf or not a number, or a batch call returned the
    # wrong count; never a silent 0. fail: the run stops naming the function, the row and the error, after saving the
    # steps already trained (exit 1). exclude: the sample is scored as failed - left out of its group's advantage
    # baseline and of the loss (its tokens masked), counted in reward/failed and the step's log line
    on_failure: str = checked("fail", choices=FAILURE_POLICIES)
    timeout_s: float = checked(60.0, resumable=True, ge=0.1)  # per call of a function (a batch call: the whole batch)
    workers: int = checked(8, resumable=True, ge=1)  # reward calls running at once (threads; sample mode)
    service: RewardServiceConfig = checked(resumable=True, default_factory=RewardServiceConfig)

    def __post_init__(self):
        labels = [f.metric_label for f in self.functions]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ConfigError(
                f"reward.functions: the label(s) {repeated} name more than one function; give each a "
                "distinct reward.functions[i].label (the metrics reward/fn/<label> must not mix them)"
            )
        if self.functions and not any(f.weight for f in self.functions):
            raise ConfigError("reward.functions: every weight is 0, so every reward would be 0; give one a weight")
