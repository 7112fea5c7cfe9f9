"""Declared KL objectives: which configuration's expected gradient is which KL's, from the exact audit.

``kl.target`` names the KL whose gradient the KL term must estimate (q: the distribution of the states
s_t the samples visit - pi on-policy, the sampler mu off-policy):

    sequence_reverse   grad KL(pi || pi_ref) over whole responses = grad E_pi[D]   (the RL objective's KL)
    token_reverse      sum_t E_{s_t~q}[grad KL_t(s_t)], the prefix distribution held fixed
    token_forward      sum_t E_{s_t~q}[grad KL(pi_ref || pi)(s_t)]

``kl.regime``: on_policy, or off_policy (samples from mu != pi: asynchronous rollouts with staleness s);
``auto`` is off_policy exactly when ``train.staleness > 0``. (The later minibatches of a multi-minibatch
update and the engine's numeric mismatch are treated as on-policy, as in every PPO implementation; the
behaviour correction's metrics measure the mismatch.)

A configuration is *unbiased for the target* when its exact expected gradient equals the target's on every
audit problem (:mod:`megatron_kl.kl.audit.exact`: tabular policies V=3, T=3, seeds ``AUDIT_SEEDS``, float64, all
sequences enumerated) to a relative error below ``UNBIASED_TOL``; ``kl.off_policy=behavior`` is judged with
the run's own behaviour correction and thresholds. ``kl.estimator=auto`` picks, among the unbiased
configurations, the one with the lowest per-sample gradient variance on those problems (ties: the simpler
configuration, in :func:`candidates` order). The audit's problems use the plain sum over tokens; the run's
aggregation (a length normalisation) is kept as configured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron_kl.kl.audit.exact import TabularProblem, all_configs, audit, behavior_configs
from megatron_kl.kl.config import TOP_K, TopKConfig, Verdict
from megatron_kl.kl.corrections import Correction, canonical
from megatron_kl.kl.objective import AUTO, TARGETS, KLConfig

AUDIT_SEEDS = (0, 1)
TOP_K_AUDIT_VOCAB, TOP_K_AUDIT_K = 4, 2  # a top-k term is audited with its teacher's top-2 of 4 tokens
AXES = ("estimator", "placement", "level", "credit", "off_policy", "truncate")


def regime_of(kl: KLConfig, staleness: int) -> str:
    """The effective regime: the declared one, or off_policy exactly when rollouts are stale."""
    if kl.regime != "auto":
        return kl.regime
    return "off_policy" if staleness > 0 else "on_policy"


def _audit_form(kl: KLConfig) -> KLConfig:
    """The configuration as the audit scores it: its axes, the plain token sum, a positive coefficient. A top-k
    distillation term keeps its tail rule with k = TOP_K_AUDIT_K of a TOP_K_AUDIT_VOCAB-token vocabulary: an
    approximation as a run's is (a top-k of all tokens is the exact KL, and with one token left the bucketed rest
    is that token; a run's top-k is far from either: ``distill.kl.top_k`` < ``model.vocab_size`` is checked)."""
    axes = {axis: getattr(kl, axis) for axis in AXES}
    if kl.estimator == TOP_K:
        return TopKConfig(**axes, coef=0.1, top_k=min(kl.top_k, TOP_K_AUDIT_K), top_k_tail=kl.top_k_tail)
    return KLConfig(**axes, coef=0.1)


@functools.lru_cache(maxsize=None)
def _problem(seed: int, vocab: int = 3) -> TabularProblem:
    return TabularProblem.random(vocab=vocab, seed=seed)


@functools.lru_cache(maxsize=4096)
def _scores(form: KLConfig, off_policy: bool, correction: Optional[Correction]) -> tuple[dict, float]:
    """(max relative bias per audit target, mean variance) over the audit problems."""
    rel: dict = {}
    variance = 0.0
    for seed in AUDIT_SEEDS:
        problem = _problem(seed, TOP_K_AUDIT_VOCAB if form.estimator == TOP_K else 3)
        row = audit(problem, off_policy, [form], corrections=(correction,) if correction else ())[0]
        for name, value in row.rel_bias.items():
            rel[name] = max(rel.get(name, 0.0), value)
        variance += row.variance / len(AUDIT_SEEDS)
    return rel, variance


def judge(kl: KLConfig, regime: str, correction: Correction) -> Verdict:
    """The audit's verdict on ``kl`` (a concrete configuration) for its ``kl.target`` in ``regime``."""
    if kl.estimator == AUTO:
        raise ValueError("judge a concrete configuration: resolve kl.estimator=auto with select() first")
    if regime not in ("on_policy", "off_policy"):
        raise ValueError(f"regime={regime!r}: use on_policy or off_policy")
    form = _audit_form(kl)
    behaviour = correction if form.off_policy == "behavior" else None
    if behaviour is not None and canonical(behaviour.kind) == "none":
        raise ValueError("kl.off_policy=behavior uses algo.behavior_correction's weights; that correction is 'none'")
    rel, variance = _scores(form, regime == "off_policy", behaviour)
    return Verdict(kl, behaviour.label if behaviour else None, kl.target, regime, rel[TARGETS[kl.target]], variance)


def candidates(regime: str, correction: Correction) -> list[KLConfig]:
    """Every configuration the trainer can run in ``regime``: the audit's rows, plus the behaviour-weighted
    ones when the run has a behaviour correction."""
    configs = all_configs(regime == "off_policy")
    if canonical(correction.kind) != "none":
        configs += behavior_configs()
    return configs


def select(kl: KLConfig, regime: str, correction: Correction) -> tuple[KLConfig, Verdict, list[Verdict]]:
    """Resolve ``kl.estimator=auto``: the lowest-variance configuration unbiased for ``kl.target`` in
    ``regime`` (every other field of ``kl`` kept). Returns it, its verdict and all candidates' verdicts."""
    verdicts = []
    for candidate in candidates(regime, correction):
        concrete = dataclasses.replace(kl, **{axis: getattr(candidate, axis) for axis in AXES})
        verdicts.append(judge(concrete, regime, correction))
    unbiased = [v for v in verdicts if v.unbiased]
    if not unbiased:
        closest = min(verdicts, key=lambda v: v.rel_bias)
        raise ValueError(
            f"kl.estimator=auto: no configuration is unbiased for kl.target={kl.target} in regime {regime} with "
            f"algo.behavior_correction={correction.label}; the closest is {closest.describe()}. Choose a "
            f"configuration explicitly, or a target/correction with an unbiased estimator (docs/kl-math.md)"
        )
    best = min(unbiased, key=lambda v: v.variance)  # min keeps the first of equal variances
    return best.config, best, verdicts
