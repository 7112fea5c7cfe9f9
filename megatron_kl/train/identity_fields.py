"""Which configuration fields make a run's identity (train/identity.py compares them on resume; the run key of
train/config.py hashes them): every field but those in :data:`RESUMABLE` and :data:`DERIVED`. Imports nothing of the
package, so the configuration can use it."""

from __future__ import annotations

from typing import Any

# Dotted prefixes that may change on resume: where outputs go and how they are logged, evaluated and
# checkpointed, timeouts and retry budgets, where servers are, how the job is launched. Evaluation draws
# from its own seeded generators, so its schedule does not move the training trajectory.
RESUMABLE = (
    "train.output_dir", "train.steps", "train.host_malloc", "train.stop_signals", "train.max_consecutive_skips",
    "train.reference_metrics_interval",
    "logging.", "eval.", "checkpoint.", "launch.", "warm_start.cache_dir", "task.math.eval_overlap",
    "task.dataset.eval_overlap",
    "parallel.distributed_timeout_s",
    "rollout.sglang.urls", "rollout.sglang.host", "rollout.sglang.port", "rollout.sglang.api_key_env",
    "rollout.sglang.sync_dir", "rollout.sglang.request_timeout_s", "rollout.sglang.max_retries",
    "rollout.sglang.backoff_s", "rollout.sglang.startup_timeout_s", "rollout.sglang.restart_dead_servers",
    "rollout.sglang.max_concurrency",
    "rollout.vllm.url", "rollout.vllm.sync_dir", "rollout.vllm.request_timeout_s", "rollout.vllm.max_retries",
    "rollout.vllm.backoff_s",
    "reward.timeout_s", "reward.workers", "reward.service.",
)


def resumable(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUMABLE)


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# resolved from fields the identity holds already (kl.estimator=auto's choice is in kl.*): not compared twice
DERIVED = ("kl_selection", "distill_selection")


def identity_fields(config: dict) -> dict[str, Any]:
    """The identity fields of a configuration given as a dict (``to_dict``), flattened to dotted paths."""
    return {k: v for k, v in flatten(config).items()
            if not resumable(k) and not any(k == d or k.startswith(d + ".") for d in DERIVED)}
