"""Scoring a step's responses: every configured reward function called (concurrently, each call under
``reward.timeout_s``), the weighted sum taken, and every failure handled by ``reward.on_failure``.

For sample ``i`` and functions ``f`` with weights ``w_f`` the reward is ``r_i = sum_f w_f r_f(i)``. A call fails when it
raises, outlives its timeout, returns something that is not a finite number (or a :class:`RewardResult` of one), or -
in batch mode - returns the wrong number of results. A failed sample never scores a silent 0:

* ``fail``: :class:`RewardFailed` names the function, the sample (its prompt and answer) and the error; the trainer
  saves the steps already finished and stops (exit 1);
* ``exclude``: the sample is marked invalid (``Scores.valid``): it is left out of its group's advantage baseline and
  out of the loss (its tokens masked), and counted (``reward/failed``, ``reward/failed_fraction``, the step's log line).

Calls run in a thread pool of ``reward.workers`` threads, off the main thread: a timed-out call is abandoned (a
thread cannot be killed), its not-yet-started neighbours move to a fresh pool so a stuck function cannot starve them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_kl.config import ConfigError
from megatron_kl.rewards.config import RewardConfig, RewardFunctionConfig, metric_segment
from megatron_kl.rewards.registry import BoundReward, bind_all
from megatron_kl.rewards.types import InvalidReward, RewardInput, RewardResult, as_result
from megatron_kl.tasks.base import Problem

log = logging.getLogger("megatron_kl.rewards")


class RewardFailed(RuntimeError):
    """A reward call failed under ``reward.on_failure=fail`` (the message names the function, the row, the error)."""


@dataclass(frozen=True)
class RewardFailure:
    where: str  # reward.functions[i] (name)
    sample: RewardInput
    error: str

    def describe(self) -> str:
        prompt = self.sample.prompt if len(self.sample.prompt) <= 80 else self.sample.prompt[:77] + "..."
        return (
            f"{self.where} failed on sample {self.sample.index} (prompt {self.sample.group}: {prompt!r}, answer "
            f"{self.sample.answer!r}): {self.error}"
        )


@dataclass
class Scores:
    """The step's rewards ``[N]`` (0 where a sample failed), which samples are valid ``[N]`` (bool), the metrics
    (``reward/fn/<label>`` with several functions, ``reward/extra/<name>``, ``reward/failed``,
    ``reward/failed_fraction``) and the failures."""

    rewards: torch.Tensor
    valid: torch.Tensor
    metrics: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)


class _Started:
    """Start times of the calls in flight (set by the worker when the call begins)."""

    def __init__(self):
        self.at: dict[int, float] = {}
        self.lock = threading.Lock()

    def wrap(self, key: int, fn, arg):
        def run():
            with self.lock:
                self.at[key] = time.monotonic()
            return fn(arg)

        return run


class RewardScorer:
    def __init__(
        self, functions: list[BoundReward], on_failure: str = "fail", timeout_s: float = 60.0, workers: int = 8
    ):
        if not functions:
            raise ValueError("RewardScorer needs at least one reward function")
        self.functions, self.on_failure, self.timeout_s, self.workers = functions, on_failure, timeout_s, workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self._scoring = threading.Lock()  # one score() at a time (a background batch and an evaluation)

    @classmethod
    def build(cls, cfg: RewardConfig, task) -> "RewardScorer":
        """The scorer of ``cfg`` for ``task`` (its tokenizer; its own reward when ``reward.functions`` is empty)."""
        functions = list(cfg.functions)
        if not functions:
            default = getattr(task, "default_reward", None)
            if default is None:
                if hasattr(task, "score"):  # a task object of one's own (the Task protocol's score)
                    return cls([task_reward(task)], cfg.on_failure, cfg.timeout_s, cfg.workers)
                raise ConfigError(
                    "reward.functions is empty and task.name=dataset has no reward of its own: name one, "
                    "e.g. reward.functions=[{name: exact_match}] or [{name: 'my_pkg.rewards:score'}] "
                    "(docs/your-own-job.md)"
                )
            functions = [RewardFunctionConfig(name=default)]
        return cls(bind_all(cfg, functions, task.tokenizer), cfg.on_failure, cfg.timeout_s, cfg.workers)

    # -- scoring --
    def score(self, samples: list[RewardInput]) -> Scores:
        with self._scoring:
            return self._score(samples)

    def _score(self, samples: list[RewardInput]) -> Scores:
        n = len(samples)
        per_function: list[list[Optional[RewardResult]]] = []
        failures: dict[int, RewardFailure] = {}
        for fn in self.functions:
            results, errors = self._run(fn, samples)
            per_function.append(results)
            for i, error in errors.items():
                failures.setdefault(i, RewardFailure(fn.where, samples[i], error))
        if failures and self.on_failure == "fail":
            first = failures[min(failures)]
            more = f" ({len(failures)} of {n} samples failed)" if len(failures) > 1 else ""
            raise RewardFailed(
                first.describe() + more + "; reward.on_failure=exclude scores such samples as failed "
                "and trains on the others"
            )
        valid = [i not in failures for i in range(n)]
        totals = [
            sum(fn.weight * results[i].reward for fn, results in zip(self.functions, per_function)) if valid[i] else 0.0
            for i in range(n)
        ]
        if failures:
            log.warning(
                "reward: %d of %d samples failed and are excluded (reward.on_failure=exclude); first: %s",
                len(failures),
                n,
                failures[min(failures)].describe(),
            )
        return Scores(
            torch.tensor(totals),
            torch.tensor(valid, dtype=torch.bool),
            self._metrics(per_function, valid),
            [failures[i] for i in sorted(failures)],
        )

    def _metrics(self, per_function, valid) -> dict:
        n = len(valid)
        out = {"reward/failed": float(n - sum(valid)), "reward/failed_fraction": (n - sum(valid)) / max(n, 1)}
        extras: dict[str, list[float]] = {}
        for fn, results in zip(self.functions, per_function):
            kept = [r for r, ok in zip(results, valid) if ok]
            if len(self.functions) > 1:
                out[f"reward/fn/{fn.label}"] = sum(r.reward for r in kept) / len(kept) if kept else 0.0
            for result in kept:
                for name, value in result.metrics.items():
                    extras.setdefault(metric_segment(name, 64), []).append(value)
        out.update({f"reward/extra/{name}": sum(v) / len(v) for name, v in extras.items()})
        return out

    def _run(self, fn: BoundReward, samples: list[RewardInput]) -> tuple[list, dict[int, str]]:
        """(results, errors by sample index) of one function over the samples."""
        if fn.mode == "batch":
            return self._run_batch(fn, samples)
        started = _Started()
        futures = {self._pool.submit(started.wrap(i, fn.call, s)): i for i, s in enumerate(samples)}
        results: list[Optional[RewardResult]] = [None] * len(samples)
        errors: dict[int, str] = {}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=min(self.timeout_s, 0.25), return_when=FIRST_COMPLETED)
            for future in done:
                i = futures[future]
                results[i], error = _result(future)
                if error:
                    errors[i] = error
            now, expired = time.monotonic(), []
            with started.lock:
                expired = [
                    f for f in pending if futures[f] in started.at and now - started.at[futures[f]] > self.timeout_s
                ]
            if expired:
                for future in expired:
                    errors[futures[future]] = f"no result within reward.timeout_s={self.timeout_s:g}s"
                pending -= set(expired)
                pending = self._fresh_pool(pending, futures, started, fn, samples)
        return results, errors

    def _fresh_pool(self, pending: set, futures: dict, started: _Started, fn: BoundReward, samples) -> set:
        """After a timeout: the calls not started yet move to a new pool (the old one keeps its stuck threads)."""
        old, self._pool = self._pool, ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="reward")
        moved = set()
        for future in list(pending):
            if future.cancel():
                i = futures.pop(future)
                replacement = self._pool.submit(started.wrap(i, fn.call, samples[i]))
                futures[replacement] = i
                moved.add(replacement)
            else:
                moved.add(future)
        old.shutdown(wait=False)
        return moved

    def _run_batch(self, fn: BoundReward, samples: list[RewardInput]):
        future = self._pool.submit(fn.call, list(samples))
        timeout = None if fn.own_deadline else self.timeout_s
        n = len(samples)
        try:
            values = future.result(timeout=timeout)
        except TimeoutError:
            self._fresh_pool(set(), {}, _Started(), fn, samples)
            return [None] * n, {
                i: f"the batch call gave no result within reward.timeout_s={self.timeout_s:g}s" for i in range(n)
            }
        except Exception as err:  # noqa: BLE001 - the user's function (or the service): reported, never a silent 0
            return [None] * n, {i: _error_text(err) for i in range(n)}
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} results" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            return [None] * n, {i: f"the batch call returned {got} for {n} samples" for i in range(n)}
        results, errors = [], {}
        for i, value in enumerate(values):
            try:
                results.append(as_result(value))
            except InvalidReward as err:
                results.append(None)
                errors[i] = str(err)
        return results, errors

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for fn in self.functions:
            fn.close()


def _result(future: Future) -> tuple[Optional[RewardResult], Optional[str]]:
    try:
        return as_result(future.result()), None
    except InvalidReward as err:
        return None, str(err)
    except Exception as err:  # noqa: BLE001 - the user's function: reported, never a silent 0
        return None, _error_text(err)


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= 300 else text[:297] + "..."


def task_reward(task) -> BoundReward:
    """A task object's own ``score(problem, response_ids)`` as a reward function (tasks written before reward
    functions existed, and tests' stand-in tasks)."""

    def score(sample: RewardInput) -> Any:
        return task.score(
            Problem(list(sample.prompt_ids), sample.answer, sample.prompt, dict(sample.fields)),
            list(sample.response_ids),
        )

    return BoundReward("task", 1.0, "sample", score, f"{type(task).__name__}.score")


def inputs_for(problems: list, completions: list, group_size: int, tokenizer) -> list[RewardInput]:
    """The RewardInput of each completion; completion ``i`` answers ``problems[i // group_size]``."""
    out = []
    for i, c in enumerate(completions):
        problem = problems[i // group_size]
        out.append(
            RewardInput(
                prompt=problem.prompt_text,
                response=tokenizer.decode(list(c.response_ids)),
                answer=problem.answer,
                prompt_ids=tuple(problem.prompt_ids),
                response_ids=tuple(c.response_ids),
                fields=getattr(problem, "fields", {}) or {},
                finish_reason=c.finish_reason or "",
                index=i,
                group=i // group_size,
            )
        )
    return out
