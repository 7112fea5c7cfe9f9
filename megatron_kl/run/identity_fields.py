"""Which configuration fields make a run's identity (run/identity.py compares them on resume; the run key of
train/config.py hashes them): every field but those declared resumable and :data:`DERIVED`. Imports nothing of the
package but the constraints, so the configuration can use it."""

from __future__ import annotations

import functools
from typing import Any

from megatron_kl.constraints import resumable_paths


@functools.lru_cache(maxsize=None)
def resumable_prefixes(config_type) -> tuple[str, ...]:
    """The paths of ``config_type`` (TrainConfig) declared resumable (``checked(..., resumable=True)``)."""
    return tuple(resumable_paths(config_type))


def resumable(key: str, prefixes) -> bool:
    """Whether dotted ``key`` is one of the resumable ``prefixes`` (a section's as ``section.``): the fields declared
    ``resumable=True`` where they are (:func:`resumable_prefixes`) - where outputs go and how they are logged,
    evaluated and checkpointed, timeouts and retry budgets, where servers are, how the job is launched. Evaluation
    draws from its own seeded generators, so its schedule does not move the training trajectory."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


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


def identity_fields(config: dict, prefixes) -> dict[str, Any]:
    """The identity fields of a configuration given as a dict (``to_dict``), flattened to dotted paths: all but the
    resumable ``prefixes`` and :data:`DERIVED`."""
    return {
        k: v
        for k, v in flatten(config).items()
        if not resumable(k, prefixes) and not any(k == d or k.startswith(d + ".") for d in DERIVED)
    }
