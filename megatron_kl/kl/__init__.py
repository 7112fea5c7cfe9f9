"""The KL library: estimators, placements, levels, credit, off-policy corrections, aggregation.

    from megatron_kl.kl import KLConfig, kl_loss, kl_shaped_returns

Here: the configuration (``config``), the estimators and the one log-ratio clamp (``estimators``), the KL term in
the reward or the loss (``objective``), RPG's losses (``rpg``), the behaviour corrections (``corrections``) and
sums along a sequence split over context-parallel ranks (``sequence_axis``). Below: ``kernels/`` (the
vocab-parallel statistics) and ``audit/`` (exact gradients on a tabular policy). The names load on first use
(``kl.config`` alone, for a configuration, needs no torch).
"""

import importlib

_HOMES = {
    "ClampCounter": "estimators",
    "KLConfig": "config",
    "aggregate_tokens": "objective",
    "kl_loss": "objective",
    "kl_penalty_credit": "objective",
    "kl_shaped_returns": "objective",
    "policy_gradient_surrogate": "objective",
}
__all__ = sorted(_HOMES)


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f"megatron_kl.kl.{_HOMES[name]}"), name)
    try:  # a submodule (megatron_kl.kl.objective after `import megatron_kl.kl`)
        return importlib.import_module(f"megatron_kl.kl.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"megatron_kl.kl.{name}":  # the submodule exists and failed to import: say why
            raise
        raise AttributeError(f"module 'megatron_kl.kl' has no attribute {name!r}") from err
