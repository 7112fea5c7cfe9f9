"""The KL library: estimators, placements, levels, credit, off-policy corrections, aggregation.

    from megatron_kl.kl import KLConfig, kl_loss, kl_shaped_returns
"""

from megatron_kl.kl.estimators import ClampCounter
from megatron_kl.kl.objective import (
    KLConfig, aggregate_tokens, kl_loss, kl_penalty_credit, kl_shaped_returns, policy_gradient_surrogate,
)

__all__ = [
    "ClampCounter", "KLConfig", "aggregate_tokens", "kl_loss", "kl_penalty_credit", "kl_shaped_returns",
    "policy_gradient_surrogate",
]
