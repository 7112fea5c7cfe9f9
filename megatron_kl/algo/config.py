"""The RL algorithm's configuration, without torch: ``AlgoConfig`` (advantage estimator, policy loss, clipping,
aggregation, behaviour correction, PPO epochs; the code is in ``algo/advantages.py``, ``algo/losses.py`` and
``kl/corrections.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_kl.config import ConfigError
from megatron_kl.constraints import check_declared, checked
from megatron_kl.kl.config import AGGREGATIONS, CORRECTIONS, PER_TOKEN_CORRECTIONS, KLConfig, RPGConfig, canonical

ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "none")  # algo/advantages.py
LOSSES = ("ppo", "rpg")
# where pi_old's log-probs come from: a forward pass of their own before the update (recompute), or - for an
# update of one epoch over one minibatch, whose only optimizer step happens after every forward - the update's
# own forward (from_update: the same weights and inputs, one policy forward per step fewer)
OLD_LOGPROBS = ("recompute", "from_update")
RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = checked("grpo", choices=ADVANTAGES)
    std_normalize: bool = True
    loss: str = checked("ppo", choices=LOSSES)  # ppo | rpg
    clip_low: float = checked(0.2, ge=0, lt=1)
    clip_high: float = checked(0.28, ge=0)
    dual_clip: Optional[float] = checked(3.0, gt=1)
    aggregation: str = checked("token_mean", choices=AGGREGATIONS)  # policy-loss aggregation
    entropy_coef: float = checked(0.0, fix="negative values penalise entropy")
    ppo_epochs: int = checked(1, ge=1)
    minibatches: int = checked(1, ge=1)  # optimizer steps per epoch
    behavior_correction: str = checked("none", choices=CORRECTIONS)  # megatron_kl.kl.corrections.CORRECTIONS
    tis_cap: float = checked(2.0, gt=0)  # truncation of token_tis / sequence_tis
    mask_low: float = checked(0.5, ge=0)  # band kept by token_mask / sequence_mask / geometric_mask / icepop
    mask_high: float = checked(2.0, gt=0)
    ratio_level: str = checked(
        "token", choices=RATIO_LEVELS
    )  # token: PPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio
    norm_length: Optional[float] = checked(
        None, gt=0
    )  # aggregation=seq_mean_token_sum_norm (Dr. GRPO); default max_new_tokens
    old_logprobs: str = checked("recompute", choices=OLD_LOGPROBS)  # OLD_LOGPROBS
    rpg: RPGConfig = field(default_factory=RPGConfig)

    def __post_init__(self):
        check_declared(self, "algo.")
        if not 0 <= self.mask_low < 1 < self.mask_high:
            raise ConfigError(
                f"algo.mask_low={self.mask_low}, algo.mask_high={self.mask_high}: the kept band must "
                "contain 1 (0 <= mask_low < 1 < mask_high)"
            )
        if self.old_logprobs == "from_update" and (self.ppo_epochs, self.minibatches) != (1, 1):
            raise ConfigError(
                f"algo.old_logprobs=from_update takes pi_old from the update's forward, which is pi_old "
                f"only when it precedes every optimizer step: set algo.ppo_epochs=1 and "
                f"algo.minibatches=1 (have {self.ppo_epochs} and {self.minibatches}) or use recompute"
            )

    @property
    def name(self) -> str:
        return self.rpg.name if self.loss == "rpg" else f"{self.advantage}-ppo"


def row_separable(kl: KLConfig, algo: Optional[AlgoConfig] = None) -> bool:
    """Whether the microbatch loss is sum_t w_t l_t(logprob_t, H_t, KL_t) with fixed weights, i.e. its
    gradient w.r.t. row t's statistics depends on row t only: PPO-clip (with TIS), the RPG losses (both
    surrogates: per-token importance weights and divergence terms, fixed aggregation weights), the entropy
    bonus, any KL in the reward (the credited values are fixed inputs), a token-level KL in the loss without
    per-decision weights. Not: a sequence-level KL in the loss (its gradient at t carries the other tokens'
    log-ratios through k'(D)), per-decision prefix weights in the loss, a sequence-level (GSPO) ratio.
    With ``algo.old_logprobs=from_update`` pi_old is the forward's own detached statistics, so also not: a
    sequence-level behaviour correction (its weight reads the other rows' pi_old) or a KL in the reward (its
    credit sums over the other rows)."""
    if algo is not None and algo.ratio_level == "sequence":
        return False
    if (
        algo is not None
        and algo.old_logprobs == "from_update"
        and (
            canonical(algo.behavior_correction) not in PER_TOKEN_CORRECTIONS
            or (kl.coef > 0 and kl.placement == "reward")
        )
    ):
        return False
    if kl.coef > 0 and kl.placement == "loss" and (kl.level != "token" or kl.off_policy == "per_decision"):
        return False
    return True
