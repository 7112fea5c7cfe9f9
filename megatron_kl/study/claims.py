"""The paper's three claims, tested on a study's runs: the comparison, a paired bootstrap interval, a verdict.

Each run is placed by its own config, never by its name: its regime (on-policy when ``train.staleness`` is 0),
its KL coefficient ``beta`` (``kl.coef``; 0 or no KL term: the control) and, for ``beta`` > 0, the exact
gradient audit's verdict on its KL term for its ``kl.target`` in that regime (:func:`train.checks.kl_verdict`).
RPG runs carry their own regulariser and are left out of the comparisons (listed as such).

An *unstable* run (declared in the study config before any run): a seed that failed, or one with an instability
event (:func:`study.report.instability_events`: a non-finite or skipped update, exact KL or grad norm above
``instability_factor`` x its run median) or a collapse (final in-domain pass@1 below ``collapse_fraction`` x
its step-0 value).

1. *On-policy, biased gradients can make training unstable*: at each ``beta`` > 0 with both groups, per seed the
   unstable fraction of the biased configurations minus that of the unbiased ones, averaged over the ``beta``s;
   the statistic is its mean over seeds (> 0: the claim's direction).
2. *On-policy, unbiased gradients give better in-domain and OOD performance*: the same pairing on final
   in-domain and OOD pass@1, unbiased minus biased (> 0 for both: the claim's direction).
3. *Off-policy, a KL term stabilises training*: at each staleness with runs of both kinds, per seed the unstable
   fraction without a KL term minus with one (> 0: the claim's direction), and the same for the collapsed
   fraction (a collapse: final in-domain pass@1 below ``collapse_fraction`` x its first evaluation; a failed run
   counts as collapsed). The first counts a grad-norm or KL spike that training recovers from as much as a
   collapse; the second is the severity statistic, blind to recovered spikes. Which one decides the verdict is
   declared in the study config (``claim3_statistic``) before its runs; the other is reported beside it, with
   final in-domain pass@1.

Intervals: 95 % percentile bootstrap over seeds (the runs of one seed share the warm start and the RL seed, so
differences are paired within a seed), 10 000 resamples. Verdict: ``reproduced`` when the interval lies above 0,
``not reproduced`` when it lies below 0 (the opposite effect), ``inconclusive`` otherwise, or with fewer than
two paired seeds; claim 2 needs both scores reproduced and is not reproduced when either is.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Optional

RESAMPLES = 10_000
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"


@dataclass
class RunOutcome:
    """What the claims need of one (configuration, seed) run."""

    configuration: str
    seed: int
    ok: bool
    unstable: bool
    final_id: Optional[float] = None
    final_ood: Optional[float] = None
    final_kl: Optional[float] = None
    collapsed: bool = False  # final in-domain pass@1 below the declared fraction of its first (failed: True)


@dataclass
class Role:
    """Where a configuration sits in the claims: regime, staleness, coefficient and bias (None: no KL term)."""

    staleness: int
    beta: float
    biased: Optional[bool]
    excluded: Optional[str] = None  # why it takes part in no comparison

    @property
    def on_policy(self) -> bool:
        return self.staleness == 0


@dataclass
class ClaimResult:
    claim: str
    comparison: str
    statistics: dict = field(default_factory=dict)  # name -> {estimate, low, high, seeds, verdict}
    verdict: str = INCONCLUSIVE
    note: str = ""


def role_of(cfg) -> Role:
    from megatron_kl.train.checks import kl_verdict

    staleness = cfg.train.staleness
    if cfg.algo.loss == "rpg":
        return Role(staleness, cfg.algo.rpg.coef, None, excluded="RPG: its own regulariser")
    verdict = kl_verdict(cfg)
    if verdict is None:
        return Role(staleness, 0.0, None)
    return Role(staleness, cfg.kl.coef, not verdict.unbiased)


def bootstrap(per_seed: dict[int, float], resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean, 2.5 %, 97.5 %) of the mean over seeds of a paired per-seed difference."""
    values = list(per_seed.values())
    estimate = statistics.fmean(values)
    if len(values) < 2:
        return estimate, math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    return estimate, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def verdict_of(low: float, high: float, seeds: int) -> str:
    if seeds < 2 or math.isnan(low):
        return INCONCLUSIVE
    if low > 0:
        return REPRODUCED
    if high < 0:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def _paired(
    outcomes: list[RunOutcome], roles: dict[str, Role], strata: dict, metric, first, second
) -> dict[int, float]:
    """Per seed: the mean over strata of mean(metric over ``first`` runs) - mean(metric over ``second`` runs).

    ``strata``: stratum key -> predicate on a Role; ``first``/``second``: predicates on a Role. A stratum counts
    for a seed when both sides have a value at that seed."""
    by_seed: dict[int, list[float]] = {}
    seeds = sorted({o.seed for o in outcomes})
    for predicate in strata.values():
        for seed in seeds:
            sides = []
            for side in (first, second):
                values = [
                    metric(o)
                    for o in outcomes
                    if o.seed == seed and predicate(roles[o.configuration]) and side(roles[o.configuration])
                ]
                values = [v for v in values if v is not None]
                sides.append(statistics.fmean(values) if values else None)
            if None not in sides:
                by_seed.setdefault(seed, []).append(sides[0] - sides[1])
    return {seed: statistics.fmean(diffs) for seed, diffs in by_seed.items()}


def _statistic(per_seed: dict[int, float]) -> dict:
    if not per_seed:
        return {"estimate": None, "low": None, "high": None, "seeds": 0, "verdict": INCONCLUSIVE}
    estimate, low, high = bootstrap(per_seed)
    return {
        "estimate": estimate,
        "low": None if math.isnan(low) else low,
        "high": None if math.isnan(high) else high,
        "seeds": len(per_seed),
        "verdict": verdict_of(low, high, len(per_seed)),
    }


def _unstable(outcome: RunOutcome) -> float:
    return float(outcome.unstable)


def _collapsed(outcome: RunOutcome) -> float:
    return float(outcome.collapsed or not outcome.ok)


CLAIM3 = {"unstable": "unstable fraction", "collapsed": "collapsed fraction"}  # claim3_statistic -> what it counts


def evaluate(
    outcomes: list[RunOutcome], roles: dict[str, Role], claim3_statistic: str = "unstable"
) -> list[ClaimResult]:
    """The three claims on these runs (module docstring); ``claim3_statistic`` (a key of :data:`CLAIM3`) decides
    the third."""
    active = {name: role for name, role in roles.items() if role.excluded is None}
    outcomes = [o for o in outcomes if o.configuration in active]
    on_betas = sorted({r.beta for r in active.values() if r.on_policy and r.biased is not None})
    strata_on = {beta: (lambda r, beta=beta: r.on_policy and r.beta == beta) for beta in on_betas}
    is_biased, is_unbiased = (lambda r: r.biased is True), (lambda r: r.biased is False)
    results = []

    claim1 = ClaimResult(
        "1. on-policy, biased gradients can make training unstable",
        f"unstable fraction, biased minus unbiased KL configurations, paired by seed, averaged over beta in {on_betas}",
    )
    claim1.statistics["unstable fraction (biased - unbiased)"] = _statistic(
        _paired(outcomes, active, strata_on, _unstable, is_biased, is_unbiased)
    )
    claim1.verdict = claim1.statistics["unstable fraction (biased - unbiased)"]["verdict"]
    if not any(o.unstable for o in outcomes if active[o.configuration].on_policy):
        claim1.note = "no on-policy run was unstable at this scale"
    results.append(claim1)

    claim2 = ClaimResult(
        "2. on-policy, unbiased gradients give better in-domain and OOD performance",
        f"final pass@1, unbiased minus biased KL configurations, paired by seed, averaged over beta in {on_betas}",
    )
    for label, metric in (
        ("in-domain pass@1 (unbiased - biased)", lambda o: o.final_id),
        ("OOD pass@1 (unbiased - biased)", lambda o: o.final_ood),
    ):
        claim2.statistics[label] = _statistic(_paired(outcomes, active, strata_on, metric, is_unbiased, is_biased))
    verdicts = [s["verdict"] for s in claim2.statistics.values()]
    claim2.verdict = (
        NOT_REPRODUCED
        if NOT_REPRODUCED in verdicts
        else REPRODUCED
        if all(v == REPRODUCED for v in verdicts)
        else INCONCLUSIVE
    )
    results.append(claim2)

    stalenesses = sorted({r.staleness for r in active.values() if not r.on_policy})
    strata_off = {s: (lambda r, s=s: r.staleness == s) for s in stalenesses}
    no_kl, with_kl = (lambda r: r.biased is None), (lambda r: r.biased is not None)
    claim3 = ClaimResult(
        "3. off-policy, a KL term stabilises training",
        f"{CLAIM3[claim3_statistic]} (declared) without minus with a KL term at the "
        f"same staleness ({stalenesses}), paired by seed",
    )
    for name, metric in (("unstable", _unstable), ("collapsed", _collapsed)):
        label = f"{CLAIM3[name]} (no KL - KL)" + ("" if name == claim3_statistic else ", not in the verdict")
        claim3.statistics[label] = _statistic(_paired(outcomes, active, strata_off, metric, no_kl, with_kl))
    claim3.statistics["in-domain pass@1 (KL - no KL), not in the verdict"] = _statistic(
        _paired(outcomes, active, strata_off, lambda o: o.final_id, with_kl, no_kl)
    )
    claim3.verdict = claim3.statistics[f"{CLAIM3[claim3_statistic]} (no KL - KL)"]["verdict"]
    if not any(o.unstable for o in outcomes if not active[o.configuration].on_policy):
        claim3.note = "no off-policy run was unstable at this scale: nothing for the KL term to stabilise"
    results.append(claim3)
    untested = {
        claim1.claim: "on-policy runs of biased and of unbiased KL configurations",
        claim2.claim: "on-policy runs of biased and of unbiased KL configurations",
        claim3.claim: "off-policy runs with and without a KL term at one staleness",
    }
    for result in results:
        if all(stat["seeds"] == 0 for stat in result.statistics.values()):
            result.note = f"not tested: the study has no {untested[result.claim]} to pair"
    return results


def markdown(results: list[ClaimResult], roles: dict[str, Role], definition: str) -> list[str]:
    """The report's Claims section."""

    def fmt(value):
        return "n/a" if value is None else f"{value:+.3f}"

    lines = [
        "## Claims",
        "",
        f"Unstable run: {definition}. Intervals: 95 % bootstrap over seeds "
        f"({RESAMPLES} resamples), paired within a seed. Verdict: reproduced when the interval lies above 0, not "
        "reproduced when below, inconclusive otherwise (or with fewer than two seeds).",
        "",
        "| claim | statistic | estimate | 95 % interval | seeds | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        for name, stat in result.statistics.items():
            interval = "n/a" if stat["low"] is None else f"[{fmt(stat['low'])}, {fmt(stat['high'])}]"
            lines.append(
                f"| {result.claim} | {name} | {fmt(stat['estimate'])} | {interval} | {stat['seeds']} | "
                f"{stat['verdict']} |"
            )
    lines += ["", "Verdicts:", ""]
    for result in results:
        note = f" ({result.note})" if result.note else ""
        lines.append(f"- **{result.claim}**: {result.verdict}{note}. Comparison: {result.comparison}.")
    lines += [
        "",
        "| configuration | regime | beta | audit for its kl.target | in the claims |",
        "|---|---|---|---|---|",
    ]
    for name, role in roles.items():
        regime = "on-policy" if role.on_policy else f"off-policy (staleness {role.staleness})"
        bias = (
            "no KL term"
            if role.biased is None and role.excluded is None
            else ("-" if role.biased is None else "biased" if role.biased else "unbiased")
        )
        used = role.excluded or (
            "1, 2" if role.on_policy and role.biased is not None else "3" if not role.on_policy else "control"
        )
        lines.append(f"| {name} | {regime} | {role.beta:g} | {bias} | {used} |")
    return lines


def _number(claim: str) -> str:
    return claim.split(".")[0].strip()


def _statistic_name(name: str) -> str:
    return name.replace(", not in the verdict", "")


def beside_published(results: list[ClaimResult], published: list[dict], source: str) -> list[str]:
    """A section putting each claim's statistics beside a published ``claims.json``'s (matched by claim number and
    statistic name): estimate, interval and verdict, then whether the verdicts agree."""

    def cell(stat):
        if stat is None:
            return "not published"
        if stat.get("estimate") is None:
            return f"n/a, {stat.get('verdict')}"
        interval = "" if stat.get("low") is None else f" [{stat['low']:+.3f}, {stat['high']:+.3f}]"
        return f"{stat['estimate']:+.3f}{interval}, {stat['seeds']} seeds, {stat['verdict']}"

    by_number = {_number(entry["claim"]): entry for entry in published}
    lines = [
        "## Beside the published verdicts",
        "",
        f"Published: `{source}`. Same statistics, same bootstrap.",
        "",
        "| claim | statistic | published | this study | verdicts agree |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        entry = by_number.get(_number(result.claim), {})
        theirs = {_statistic_name(name): stat for name, stat in entry.get("statistics", {}).items()}
        for name, stat in result.statistics.items():
            other = theirs.get(_statistic_name(name))
            agree = "-" if other is None else ("yes" if other.get("verdict") == stat["verdict"] else "no")
            lines.append(f"| {result.claim} | {name} | {cell(other)} | {cell(stat)} | {agree} |")
        if entry:
            agree = "yes" if entry.get("verdict") == result.verdict else "no"
            lines.append(f"| {result.claim} | **verdict** | {entry.get('verdict')} | {result.verdict} | {agree} |")
    return lines
