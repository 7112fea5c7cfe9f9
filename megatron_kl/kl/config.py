"""The KL library's configuration, without torch: ``KLConfig`` (the KL term: estimator, placement, level,
credit, off-policy correction, aggregation; their meaning is in ``kl/objective.py`` and docs/kl-math.md),
and ``RPGConfig`` (``kl/rpg.py``); the sampler's top-k / top-p rule is ``vocab_parallel/config.Truncation``.
Loading and validating a configuration imports this module, not the kernels."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_kl.constraints import check_declared, checked
from megatron_kl.registry import Registry


@dataclass(frozen=True)
class EstimatorSpec:
    """A KL estimator (``kl.estimator``). With d = log pi_theta(y|s) - log pi_ref(y|s) at the sampled token (clamped
    to +-kl.clamp), a per-token estimator is ``value(d)``, a differentiable tensor function: the KL term adds
    ``value(d_t)`` per token (level=token) or ``value(sum_t d_t)`` per sequence (level=sequence), its gradient
    flowing through d. ``full_distribution``: the estimate is the exact KL over the vocabulary per position (the
    vocab-parallel kernels compute it from both models' logits; ``value`` is unused). Whether an estimator gives the
    gradient of the KL in a given placement, level and regime is the exact audit's verdict (``megatron-kl audit``),
    which enumerates every registered estimator."""

    name: str
    value: Optional[Callable] = None
    full_distribution: bool = False
    description: str = ""

    def __post_init__(self):
        if (self.value is None) != self.full_distribution:
            raise ValueError(
                f"estimator {self.name!r}: give value(d) for a per-token estimator, or "
                "full_distribution=True (and no value) for the exact KL over the vocabulary"
            )


ESTIMATORS: Registry[EstimatorSpec] = Registry("KL estimator", EstimatorSpec)
for _spec in (
    # tensor methods only: this module imports no torch
    EstimatorSpec("k1", lambda d: d, description="d; E_pi[k1] = KL, grad k1 = grad log pi (zero mean)"),
    EstimatorSpec("k2", lambda d: 0.5 * d.square(), description="d^2 / 2; grad = d grad log pi"),
    EstimatorSpec(
        "k3", lambda d: (-d).exp() - 1.0 + d, description="exp(-d) - 1 + d; E_pi[grad k3] = grad of the forward KL"
    ),
    EstimatorSpec("full", full_distribution=True, description="the exact KL over the vocabulary per position"),
):
    ESTIMATORS.register(_spec)


def estimator_spec(name: str) -> EstimatorSpec:
    return ESTIMATORS.get(name, "kl.estimator")


LOG_RATIO_CLAMP = 20.0  # |log-ratio| bound before any exp: the KL term's, RPG's, the policy ratio's, the corrections'
PLACEMENTS = ("reward", "loss")
LEVELS = ("token", "sequence")
CREDITS = ("reward_to_go", "immediate")
# behavior: the trainer's behaviour-correction weights omega_t (algo.behavior_correction, detached, from
# pi_old / mu) multiply the KL term's per-token integrand; which gradient that gives is the audit's verdict.
OFF_POLICY = ("none", "token_is", "per_decision", "behavior")
# kl.target: the KL whose gradient the term should estimate (audit names: seq, token, forward)
TARGETS = {"sequence_reverse": "seq", "token_reverse": "token", "token_forward": "forward"}
# kl.regime: where the samples come from; auto: off_policy when train.staleness > 0
REGIMES = ("auto", "on_policy", "off_policy")
AUTO = "auto"  # kl.estimator=auto: the trainer picks the configuration (megatron_kl.kl.audit.targets)
TOP_K = "topk"  # a term to another model known on its top-k tokens only (TopKConfig; megatron_kl.kl.topk)
TOP_K_TAILS = ("bucket", "renormalize")  # what stands for the rest of the vocabulary in the top-k divergence
# seq_mean_token_sum_norm (Dr. GRPO): each sequence's token sum divided by a fixed length ``norm_length``
# (the trainer sets rollout.sampling.max_new_tokens unless algo.norm_length is given), then the mean over
# sequences: no length-dependent weight per token, unlike token_mean and seq_mean_token_mean.
AGGREGATIONS = ("seq_mean_token_sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# behaviour corrections (algo.behavior_correction; their weights: kl/corrections.py)
CORRECTIONS = ("none", "tis", "token_tis", "sequence_tis", "token_mask", "sequence_mask", "geometric_mask", "icepop")
# corrections whose weight c_t depends on token t's own ratio w_t only (not on the rest of its sequence)
PER_TOKEN_CORRECTIONS = ("none", "token_tis", "token_mask", "icepop")


def canonical(kind: str) -> str:
    """A correction's name with its alias resolved (tis is token_tis)."""
    return "token_tis" if kind == "tis" else kind


@dataclass(frozen=True)
class KLConfig:
    # k1 | k2 | k3 | full (exact over the vocabulary) | auto: estimator, placement, level, credit and off_policy
    # chosen by the audit for kl.target
    estimator: str = checked("k1", choices=ESTIMATORS.and_names(AUTO))
    placement: str = checked(
        "reward", choices=PLACEMENTS
    )  # reward: -beta * KL added to the reward; loss: beta * KL added to the loss
    level: str = checked(
        "token", choices=LEVELS
    )  # token: per-token estimates; sequence: the sequence sum as one estimate
    credit: Optional[str] = checked(
        None, choices=CREDITS
    )  # reward placement: reward_to_go | immediate; None means reward_to_go there
    # importance weighting of the KL term for off-policy samples: none | token_is | per_decision | behavior
    off_policy: str = checked("none", choices=OFF_POLICY)
    coef: float = checked(0.001, ge=0)  # beta, the KL coefficient
    clamp: Optional[float] = checked(LOG_RATIO_CLAMP, gt=0)  # |log-ratio| bound before any exp (k3, importance weights)
    truncate: Optional[float] = checked(None, gt=0)  # cap on per-decision weights rho_{1:t}
    aggregation: str = checked(
        "seq_mean_token_sum", choices=AGGREGATIONS
    )  # how per-token terms become the loss (AGGREGATIONS)
    norm_length: Optional[float] = checked(None, gt=0)  # the constant of aggregation='seq_mean_token_sum_norm'
    target: str = checked(
        "sequence_reverse", choices=tuple(TARGETS)
    )  # the declared objective (TARGETS); runs biased for it are tagged kl/biased
    regime: str = checked("auto", choices=REGIMES)  # on_policy | off_policy | auto (from train.staleness)
    strict: bool = False  # a configuration biased for the target is an error instead of a warning

    def __post_init__(self):
        check_declared(self)  # each field's declared choices and bounds
        if self.credit is not None:
            if self.placement != "reward":
                raise ValueError("KLConfig.credit applies to placement='reward' only; remove it for placement='loss'")
            if self.level == "sequence":
                raise ValueError(
                    "KLConfig.credit does not apply at level='sequence' (every token gets the sequence estimate)"
                )
        if self.truncate is not None:
            if self.off_policy != "per_decision":
                raise ValueError(
                    "KLConfig.truncate caps per-decision weights: set off_policy='per_decision' or drop it"
                )
        self._check_off_policy()

    def _check_off_policy(self):
        op = self.off_policy
        if op in ("none", "behavior") or self.estimator == AUTO:
            return
        if self.placement == "loss":
            if self.exact:
                if not (op == "per_decision" and self.level == "sequence"):
                    raise ValueError(
                        "KLConfig.off_policy: with estimator='full' in the loss only 'per_decision' at level='sequence' "
                        "(Rao-Blackwellised) is defined; the exact token-level KL needs no weight"
                    )
            elif op != "token_is" or self.level != "token":
                raise ValueError(
                    f"KLConfig.off_policy={op!r} with placement='loss' and estimator={self.estimator!r}: "
                    "use 'token_is' at level='token' (w_t * k_t), or estimator='full', level='sequence' for per_decision"
                )
        else:
            if self.level == "sequence":
                raise ValueError(f"KLConfig.off_policy={op!r} with placement='reward' needs level='token'")
            if op == "per_decision" and self.effective_credit != "reward_to_go":
                raise ValueError("KLConfig.off_policy='per_decision' needs credit='reward_to_go'")

    @property
    def exact(self) -> bool:
        """The estimator is the exact KL over the vocabulary per position (``full``, or a registered estimator with
        ``full_distribution``): the step computes it from both models' logits."""
        return self.estimator not in (AUTO, TOP_K) and estimator_spec(self.estimator).full_distribution

    @property
    def effective_credit(self) -> Optional[str]:
        if self.placement != "reward" or self.level == "sequence":
            return None
        return self.credit or "reward_to_go"

    @property
    def name(self) -> str:
        """A readable, unique label for logs and plots, e.g. ``k1-reward-token-rtg``."""
        if self.estimator == AUTO:
            return f"auto-{self.target}"
        # an estimator from a module (package.module:ATTR) by its spec's name
        estimator = estimator_spec(self.estimator).name if ":" in self.estimator else self.estimator
        parts = [estimator, self.placement, self.level]
        credit = self.effective_credit
        if credit:
            parts.append({"reward_to_go": "rtg", "immediate": "imm"}[credit])
        if self.off_policy != "none":
            parts.append(self.off_policy)
        if self.truncate is not None:
            parts.append(f"trunc{self.truncate:g}")
        return "-".join(parts)


DIVERGENCES = ("rkl", "fkl", "urkl", "ufkl")
SURROGATES = ("differentiable", "reinforce")


@dataclass(frozen=True)
class TopKConfig(KLConfig):
    """A KL term whose other model may be known on its ``top_k`` most likely tokens per position only (a served
    distillation teacher's top-k log-probs). ``estimator=topk``: the per-position KL is the top-k divergence
    ``top_k_tail`` (bucket: the rest of the vocabulary as one outcome, a lower bound of the KL; renormalize: both
    distributions restricted to the top-k; megatron_kl.kl.topk), used where ``full`` uses the exact KL (every placement
    and level, the same rules): the unbiased gradient of that approximation, not of the KL (the audit measures the
    gap). Any other estimator: KLConfig's."""

    # k1 | k2 | k3 | full (exact over the vocabulary) | topk (the other model known on its top-k tokens: the top-k
    # divergence in the exact KL's place, an approximation) | auto (the audit's unbiased choice for kl.target)
    estimator: str = checked("k1", choices=ESTIMATORS.and_names(TOP_K, AUTO))
    top_k: int = checked(20, ge=1)  # estimator=topk: the other model's tokens per position
    top_k_tail: str = checked("bucket", choices=TOP_K_TAILS)  # estimator=topk: what stands for the rest

    def __post_init__(self):
        if self.estimator == TOP_K:
            check_declared(self)
            self.per_position()  # built, so checked: the exact term's rules are the top-k term's
            return
        super().__post_init__()

    @property
    def name(self) -> str:
        """``topk20_bucket-loss-sequence`` for the top-k approximation, else the KLConfig's name."""
        if self.estimator != TOP_K:
            return super().name
        return f"topk{self.top_k}_{self.top_k_tail}-" + self.per_position().name.split("-", 1)[1]

    def per_position(self) -> KLConfig:
        """The configuration the objective functions run: ``topk`` is the exact term's machinery (estimator
        ``full``) with the top-k divergence in the exact KL's place; any other estimator as it is."""
        return dataclasses.replace(self, estimator="full") if self.estimator == TOP_K else self


@dataclass(frozen=True)
class RPGConfig:
    divergence: str = checked("urkl", choices=DIVERGENCES)
    surrogate: str = checked("reinforce", choices=SURROGATES)
    coef: float = checked(0.001, ge=0)  # beta
    clip_low: Optional[float] = checked(0.2, ge=0, lt=1)
    clip_high: Optional[float] = checked(0.28, ge=0)
    dual_clip: Optional[float] = checked(3.0, gt=1)
    clamp: Optional[float] = checked(LOG_RATIO_CLAMP, gt=0)
    aggregation: str = checked("token_mean", choices=AGGREGATIONS)
    norm_length: Optional[float] = checked(None, gt=0)  # aggregation='seq_mean_token_sum_norm' (the trainer sets it)

    def __post_init__(self):
        check_declared(self)
        if self.surrogate == "differentiable" and any(
            v is not None for v in (self.clip_low, self.clip_high, self.dual_clip)
        ):
            raise ValueError("RPGConfig clip_low/clip_high/dual_clip apply to surrogate='reinforce'; set them to None")

    @property
    def name(self) -> str:
        return f"rpg-{self.divergence}-{self.surrogate}"


UNBIASED_TOL = 1e-9  # the exact audit's relative error below which a configuration counts as unbiased


@dataclass(frozen=True)
class Verdict:
    """The exact audit's judgement of one KL configuration for a declared target and regime
    (``megatron_kl.kl.audit.targets.judge``; what ``kl.estimator=auto`` chose is one)."""

    config: KLConfig
    correction: Optional[str]  # the behaviour correction's label when off_policy='behavior'
    target: str
    regime: str
    rel_bias: float  # max over the audit problems of |E[g] - grad target| / |grad target|
    variance: float  # mean over the audit problems of the per-sample gradient variance

    @property
    def unbiased(self) -> bool:
        return self.rel_bias < UNBIASED_TOL

    def describe(self) -> str:
        name = self.config.name + (f"[{self.correction}]" if self.correction else "")
        state = "unbiased" if self.unbiased else f"BIASED (relative bias {self.rel_bias:.3g})"
        return f"{name}: {state} for kl.target={self.target} in regime {self.regime}"
