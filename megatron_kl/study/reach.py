"""Which configuration reached a target score first (a distillation teacher's), and by how many steps.

A run reaches the target at its first evaluation whose ``reach_metric`` is >= ``reach_target``. Per configuration:
the seeds that reached it and the median first step. The comparison: the configuration that reached it first (most
seeds, then the lowest median step) against each other one, paired by seed (the runs of one seed share the warm
start and the RL seed), the difference in first step with a 95 % percentile bootstrap interval over seeds
(:func:`megatron_kl.study.claims.bootstrap`). A seed that never reached the target counts at the run's last step plus
one: the difference is then a lower bound, and the table says how many seeds were censored.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional

from megatron_kl.study.claims import bootstrap
from megatron_kl.study.series import final, series


def first_step(records: list[dict], metric: str, target: float) -> Optional[int]:
    """The first evaluated step whose ``metric`` is >= ``target`` (None: never)."""
    values = series(records, metric)
    return next((step for step in sorted(values) if values[step] >= target), None)


@dataclass
class Reach:
    configuration: str
    first: dict[int, Optional[int]]  # seed -> first step (None: never)
    horizon: int  # the runs' last step + 1: where a seed that never reached it is counted

    @property
    def reached(self) -> int:
        return sum(step is not None for step in self.first.values())

    def counted(self, seed: int) -> int:
        step = self.first[seed]
        return self.horizon if step is None else step

    @property
    def median(self) -> Optional[float]:
        """Median first step over the seeds (a seed that never reached it counted at the horizon); None when no
        seed reached it."""
        if not self.reached:
            return None
        return statistics.median(self.counted(seed) for seed in self.first)


def reaches(runs: dict[str, dict[int, list[dict]]], metric: str, target: float) -> list[Reach]:
    """One :class:`Reach` per configuration, first-reacher first. ``runs``: configuration -> seed -> records."""
    horizon = 1 + max(
        (r["step"] for by_seed in runs.values() for records in by_seed.values() for r in records), default=0
    )
    out = [
        Reach(name, {seed: first_step(records, metric, target) for seed, records in by_seed.items()}, horizon)
        for name, by_seed in runs.items()
    ]
    return sorted(out, key=lambda r: (-r.reached, math.inf if r.median is None else r.median))


def comparisons(ranked: list[Reach]) -> list[dict]:
    """The first reacher against each other configuration: the per-seed difference (other - first) in first step
    over their common seeds, its mean and bootstrap interval, and the censored seeds."""
    if not ranked:
        return []
    best = ranked[0]
    out = []
    for other in ranked[1:]:
        seeds = sorted(set(best.first) & set(other.first))
        if not seeds:
            continue
        per_seed = {seed: float(other.counted(seed) - best.counted(seed)) for seed in seeds}
        estimate, low, high = bootstrap(per_seed)
        censored = sum(other.first[s] is None or best.first[s] is None for s in seeds)
        out.append(
            {
                "first": best.configuration,
                "other": other.configuration,
                "seeds": len(seeds),
                "estimate": estimate,
                "low": None if math.isnan(low) else low,
                "high": None if math.isnan(high) else high,
                "censored": censored,
            }
        )
    return out


def markdown(
    ranked: list[Reach], metric: str, target: float, finals: Optional[dict[str, dict[str, Optional[float]]]] = None
) -> list[str]:
    """The section; ``finals``: configuration -> {label: value} shown beside (the final score, the KL to the teacher)."""
    labels = sorted({label for row in (finals or {}).values() for label in row})
    lines = [
        f"## Reaching {metric} >= {target:g}",
        "",
        "First evaluated step at which each seed's score reached the target; a seed that never did is counted at "
        "the last step + 1 (the differences are then lower bounds). Intervals: 95 % bootstrap over seeds, "
        "paired within a seed.",
        "",
        "| configuration | seeds reached | median first step | first step per seed |"
        + "".join(f" {label} |" for label in labels),
        "|---|---|---|---|" + "---|" * len(labels),
    ]
    for reach in ranked:
        per_seed = ", ".join(f"{seed}: {'never' if step is None else step}" for seed, step in reach.first.items())
        median = "never" if reach.median is None else f"{reach.median:g}"
        extra = (finals or {}).get(reach.configuration, {})
        cells = "".join(f" {'n/a' if extra.get(label) is None else f'{extra[label]:.3g}'} |" for label in labels)
        lines.append(f"| {reach.configuration} | {reach.reached}/{len(reach.first)} | {median} | {per_seed} |{cells}")
    lines.append("")
    if not ranked or not ranked[0].reached:
        lines.append("No configuration reached the target.")
        return lines
    for row in comparisons(ranked):
        interval = "n/a (one seed)" if row["low"] is None else f"[{row['low']:+.1f}, {row['high']:+.1f}]"
        bound = f" (a lower bound: {row['censored']} censored seed(s))" if row["censored"] else ""
        lines.append(
            f"- **{row['first']}** reached it before **{row['other']}** by {row['estimate']:+.1f} steps "
            f"on average over {row['seeds']} seeds, 95 % interval {interval}{bound}."
        )
    return lines


def final_value_comparisons(
    runs: dict[str, dict[int, list[dict]]], metric: str, lower_is_better: bool = True
) -> list[dict]:
    """The configuration with the best mean final ``metric`` (e.g. distill/exact_token, the KL to the teacher)
    against each other one that logged it: the per-seed difference (other - best), its mean and bootstrap interval."""
    finals = {
        name: {seed: value for seed, records in by_seed.items() if (value := final(records, metric)) is not None}
        for name, by_seed in runs.items()
    }
    finals = {name: values for name, values in finals.items() if values}
    if len(finals) < 2:
        return []
    sign = 1.0 if lower_is_better else -1.0
    best = min(finals, key=lambda name: sign * statistics.fmean(finals[name].values()))
    out = []
    for other, values in finals.items():
        seeds = sorted(set(values) & set(finals[best]))
        if other == best or not seeds:
            continue
        estimate, low, high = bootstrap({seed: values[seed] - finals[best][seed] for seed in seeds})
        out.append(
            {
                "best": best,
                "other": other,
                "seeds": len(seeds),
                "estimate": estimate,
                "low": None if math.isnan(low) else low,
                "high": None if math.isnan(high) else high,
            }
        )
    return out


def final_value_markdown(rows: list[dict], metric: str, what: str) -> list[str]:
    if not rows:
        return []
    lines = [f"Final {what} (`{metric}`), paired by seed:", ""]
    for row in rows:
        interval = "n/a (one seed)" if row["low"] is None else f"[{row['low']:+.3g}, {row['high']:+.3g}]"
        lines.append(
            f"- **{row['best']}** ended {row['estimate']:.3g} below **{row['other']}** on average over "
            f"{row['seeds']} seeds, 95 % interval {interval}."
        )
    return lines + [""]
