"""Figures and a markdown report of a study from its runs' metrics.jsonl and status.json.

Figures (``figures/``): reward, in-domain pass@1, exact KL to the reference, entropy and grad norm against
step (one line per configuration: mean over seeds, min-max across seeds shaded), and final in-domain vs
OOD pass@1 bars. Report (``report.md``): one table row per configuration - seeds ok/failed, final and best
scores, instability events (steps where the exact KL or the grad norm exceeds ``instability_factor`` x
the run's median, or is not finite), stability (``stable``: every seed finished without an event), the
``kl/biased`` tag the runs logged, and the exact gradient audit's verdict on that KL configuration for its
``kl.target`` in its regime (:mod:`megatron_kl.kl.audit.targets`). Failed runs are listed with their log tail.
A score no run reported (e.g. OOD without OOD problems) is ``n/a`` in the table and has no bar.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_kl.constraints import paths_unchecked
from megatron_kl.study import claims
from megatron_kl.study import reach as reaching
from megatron_kl.study.claim_figures import claim_figures
from megatron_kl.study.claims import RunOutcome
from megatron_kl.study.grid import RunSpec, StudyConfig
from megatron_kl.study.series import final as _final
from megatron_kl.study.series import series as _series
from megatron_kl.train.checks import kl_verdict
from megatron_kl.train.config import load_train_config
from megatron_kl.train.metrics import read_metrics

CURVES = [
    ("reward/mean", "reward"),
    ("eval/id/pass@1", "in-domain pass@1"),
    ("kl/exact_token", "exact KL / token"),
    ("distill/exact_token", "exact KL to the teacher / token"),
    ("entropy/mean", "entropy"),
    ("optim/grad_norm", "grad norm"),
]
FINAL = [
    ("eval/id/pass@1", "ID pass@1"),
    ("eval/id/mean@k", "ID mean@k"),
    ("eval/ood/pass@1", "OOD pass@1"),
    ("eval/ood/mean@k", "OOD mean@k"),
]


def _instabilities(records: list[dict], factor: float) -> int:
    """Steps whose exact KL or grad norm is not finite or above ``factor`` x the run's median, plus the updates the
    trainer skipped as non-finite (``optim/skipped_updates``, a running count)."""
    events = 0
    for key in ("kl/exact_token", "optim/grad_norm"):
        values = [r.get(key) for r in records if key in r]
        finite = [v for v in values if v is not None and math.isfinite(v)]
        median = statistics.median(finite) if finite else 0.0
        events += sum(1 for v in values if v is None or not math.isfinite(v) or (median > 0 and v > factor * median))
    skipped = [r["optim/skipped_updates"] for r in records if r.get("optim/skipped_updates") is not None]
    return events + int(max(skipped, default=0))


def collapsed(records: list[dict], fraction: float) -> bool:
    """Final in-domain pass@1 below ``fraction`` x its first evaluation's (False without two evaluations)."""
    series = _series(records, "eval/id/pass@1")
    if len(series) < 2 or fraction <= 0:
        return False
    return series[max(series)] < fraction * series[min(series)]


def audit_verdict(cfg) -> str:
    """The audit's verdict on the run's KL term for its kl.target, in its regime (megatron_kl.kl.audit.targets)."""
    if cfg.algo.loss == "rpg":
        return f"RPG {cfg.algo.rpg.divergence}: exact gradient of its regularised objective (kl-math.md)"
    verdict = kl_verdict(cfg)
    if verdict is None:
        return "no KL term"
    chosen = " (kl.estimator=auto)" if cfg.kl_selection is not None else ""
    return verdict.describe() + chosen


def stability(seeds_ok: int, failed: int, events: int, collapses: int = 0) -> str:
    """``stable``: every seed finished without an instability event or a collapse; else what went wrong."""
    if seeds_ok == 0:
        return "no finished seed"
    problems = (
        ([f"{failed} seed(s) failed"] if failed else [])
        + ([f"{events} events"] if events else [])
        + ([f"{collapses} collapsed"] if collapses else [])
    )
    return "unstable: " + ", ".join(problems) if problems else "stable"


def _tagged_biased(records: list[dict]) -> Optional[bool]:
    """Whether any finished seed logged kl/biased=1; None when no seed logged the tag (no KL term)."""
    tags = [r["kl/biased"] for run in records for r in run if r.get("kl/biased") is not None]
    return any(t > 0 for t in tags) if tags else None


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


@dataclass
class FinishedRun:
    """One seed's finished run: its metrics and its stability, judged once by the study's definition."""

    seed: int
    records: list[dict]
    events: int  # instability events (:func:`_instabilities`)
    collapsed: bool

    @property
    def unstable(self) -> bool:
        return self.events > 0 or self.collapsed


@dataclass
class FailedRun:
    seed: int
    name: str
    entry: dict  # its status.json entry


@dataclass
class ConfigurationRuns:
    """A configuration's runs, finished and failed."""

    overrides: list[str]
    finished: list[FinishedRun] = field(default_factory=list)
    failed: list[FailedRun] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # never started, or interrupted: nothing is computed from them

    @property
    def records(self) -> list[list[dict]]:
        return [run.records for run in self.finished]


def collect(study: StudyConfig, runs: list[RunSpec], status: dict) -> dict[str, ConfigurationRuns]:
    """Per configuration: its finished runs (metrics and stability), its failures, and the runs that have not run
    (no state in ``status.json``, or interrupted by a stop signal: they resume, nothing is judged from them)."""
    groups: dict[str, ConfigurationRuns] = {}
    for spec in runs:
        group = groups.setdefault(spec.configuration, ConfigurationRuns(spec.overrides))
        entry = status.get(spec.name, {"state": "not run"})
        metrics = spec.output_dir / "metrics.jsonl"
        if entry.get("state") == "ok" and metrics.is_file():
            records = read_metrics(metrics)
            group.finished.append(
                FinishedRun(
                    spec.seed,
                    records,
                    _instabilities(records, study.instability_factor),
                    collapsed(records, study.collapse_fraction),
                )
            )
        elif entry.get("state") in ("ok", "failed"):  # ok without its metrics: failed, the files are gone
            group.failed.append(FailedRun(spec.seed, spec.name, entry))
        else:
            group.not_run.append(spec.name)
    return groups


def _figures(groups: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.6))
    for ax, (key, title) in zip(axes, CURVES):
        for name, group in groups.items():
            series = [_series(records, key) for records in group.records]
            steps = sorted(set().union(*series)) if series else []
            if not steps:
                continue
            rows = [[s[t] for s in series if t in s] for t in steps]
            mean = [sum(r) / len(r) for r in rows]
            (line,) = ax.plot(steps, mean, label=name, marker="." if key.startswith("eval") else None)
            if len(series) > 1:
                ax.fill_between(
                    steps, [min(r) for r in rows], [max(r) for r in rows], alpha=0.2, color=line.get_color()
                )
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    curves = out / "curves.png"
    fig.savefig(curves, dpi=100)
    plt.close(fig)

    names = list(groups)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names)), 3.6))
    width = 0.4
    for offset, (key, label) in (
        (-width / 2, ("eval/id/pass@1", "in-domain")),
        (width / 2, ("eval/ood/pass@1", "OOD")),
    ):
        finals = [_mean(_final(records, key) for records in groups[n].records) for n in names]
        present = [(i + offset, v) for i, v in enumerate(finals) if v is not None]  # missing: no bar, not 0
        ax.bar([x for x, _ in present], [v for _, v in present], width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("final pass@1")
    ax.legend()
    fig.tight_layout()
    bars = out / "final_pass1.png"
    fig.savefig(bars, dpi=100)
    plt.close(fig)
    return [str(curves), str(bars)]


def _best(records: list[dict], key: str) -> Optional[float]:
    series = _series(records, key)
    return max(series.values()) if series else None


def outcomes(groups: dict[str, ConfigurationRuns]) -> list:
    """One :class:`claims.RunOutcome` per (configuration, seed), failed runs included (unstable)."""
    result = []
    for name, group in groups.items():
        for run in group.finished:
            result.append(
                RunOutcome(
                    name,
                    run.seed,
                    True,
                    run.unstable,
                    _final(run.records, "eval/id/pass@1"),
                    _final(run.records, "eval/ood/pass@1"),
                    _final(run.records, "kl/exact_token"),
                    run.collapsed,
                )
            )
        result += [RunOutcome(name, run.seed, False, True) for run in group.failed]
    return result


def instability_definition(study: StudyConfig) -> str:
    return (
        f"a failed seed, a non-finite or skipped update, an exact KL or grad norm above "
        f"{study.instability_factor:g}x its run median, or final in-domain pass@1 below "
        f"{study.collapse_fraction:g}x its first evaluation"
    )


def _runtime(status: dict) -> str:
    seconds = [entry.get("seconds") for entry in status.values() if entry.get("seconds") is not None]
    if not seconds:
        return ""
    return f"Runtime: {sum(seconds) / 60:.1f} min for {len(seconds)} runs (the sum of the runs' wall times)."


def write_report(study: StudyConfig, runs: list[RunSpec], status: dict) -> dict:
    out = Path(study.output_dir)
    groups = collect(study, runs, status)

    with paths_unchecked():  # the runs' recorded configurations, read for their roles: their paths may be gone
        configs = {name: load_train_config(study.base, group.overrides) for name, group in groups.items()}
    run_roles = {name: claims.role_of(cfg) for name, cfg in configs.items()}
    claim_results = claims.evaluate(outcomes(groups), run_roles, study.claim3_statistic)
    figures = claim_figures(groups, run_roles, out / "figures") + _figures(groups, out / "figures")
    lines = [
        f"# Study `{study.name}`",
        "",
        f"Base config `{study.base}`, seeds {study.seeds}, common overrides `{' '.join(study.common) or '-'}`"
        + (f", configurations matching {study.only}" if study.only else "")
        + ".",
        "Scores are means over the seeds that finished; best = max over evaluations. Instability events: "
        f"steps where the exact KL or the grad norm exceeds {study.instability_factor:g}x the run median or "
        "is not finite, and skipped non-finite updates (summed over seeds); collapsed: final in-domain pass@1 "
        f"below {study.collapse_fraction:g}x the first evaluation's.",
        _runtime(status),
        "",
    ]
    if study.caveat:
        lines += [f"> **Caveat:** {study.caveat}", ""]
    not_run = [name for group in groups.values() for name in group.not_run]
    if not_run:
        lines += [
            f"> **Unfinished study:** {len(not_run)} of {len(runs)} runs have not run or were interrupted "
            f"({', '.join(not_run)}); nothing below is computed from them. Run the study again to finish it.",
            "",
        ]
    reach = None
    if study.reach_target is not None:
        ranked = reaching.reaches(
            {name: {run.seed: run.records for run in group.finished} for name, group in groups.items()},
            study.reach_metric,
            study.reach_target,
        )
        finals = {
            name: {
                f"final {study.reach_metric}": _mean(_final(r, study.reach_metric) for r in group.records),
                "final KL to the teacher / token": _mean(_final(r, "distill/exact_token") for r in group.records),
            }
            for name, group in groups.items()
        }
        lines += reaching.markdown(ranked, study.reach_metric, study.reach_target, finals) + [""]
        by_seed = {name: {run.seed: run.records for run in group.finished} for name, group in groups.items()}
        to_teacher = reaching.final_value_comparisons(by_seed, "distill/exact_token")
        lines += reaching.final_value_markdown(to_teacher, "distill/exact_token", "KL to the teacher per token")
        reach = {
            "metric": study.reach_metric,
            "target": study.reach_target,
            "first_steps": {r.configuration: r.first for r in ranked},
            "comparisons": reaching.comparisons(ranked),
            "final_kl_to_teacher": to_teacher,
        }
    lines += claims.markdown(claim_results, run_roles, instability_definition(study))
    if study.published:
        lines += [""] + claims.beside_published(
            claim_results, json.loads(Path(study.published).read_text()), study.published
        )
    lines += [
        "",
        "## Results",
        "",
        "| configuration | seeds ok | failed | not run | final reward | "
        + " | ".join(f"final {label}" for _, label in FINAL)
        + " | best ID pass@1 | final exact KL | instability events | stability | kl/biased | audit |",
        "|" + "---|" * (11 + len(FINAL)),
    ]
    summary = {}
    for name, group in groups.items():
        records = group.records
        row = {
            "seeds_ok": len(records),
            "failed": [run.name for run in group.failed],
            "not_run": list(group.not_run),
            "final_reward": _mean(_final(r, "reward/mean") for r in records),
            **{key: _mean(_final(r, key) for r in records) for key, _ in FINAL},
            "best_id_pass1": _mean(_best(r, "eval/id/pass@1") for r in records),
            "final_exact_kl": _mean(_final(r, "kl/exact_token") for r in records),
            "instability_events": sum(run.events for run in group.finished),
            "kl_biased": _tagged_biased(records),
            "audit": audit_verdict(configs[name]),
        }
        row["collapsed_seeds"] = sum(run.collapsed for run in group.finished)
        row["stability"] = stability(
            row["seeds_ok"], len(row["failed"]), row["instability_events"], row["collapsed_seeds"]
        )
        biased = {None: "n/a", True: "1", False: "0"}[row["kl_biased"]]
        summary[name] = row
        lines.append(
            f"| {name} | {row['seeds_ok']} | {len(row['failed'])} | {len(row['not_run'])} | "
            f"{_fmt(row['final_reward'])} | "
            + " | ".join(_fmt(row[key]) for key, _ in FINAL)
            + f" | {_fmt(row['best_id_pass1'])} | {_fmt(row['final_exact_kl'])} | "
            f"{row['instability_events']} | {row['stability']} | {biased} | {row['audit']} |"
        )
    lines += ["", "## Figures", ""] + [f"![{Path(f).stem}](figures/{Path(f).name})" for f in figures]
    failures = [run for group in groups.values() for run in group.failed]
    lines += ["", "## Failed runs", ""]
    if not failures:
        lines.append("None.")
    for run in failures:
        entry = run.entry
        lines += [
            f"### {run.name}",
            "",
            f"state: {entry.get('state')}, exit code {entry.get('returncode')}, log `{entry.get('log')}`",
            "",
            "```",
            entry.get("error_tail", ""),
            "```",
            "",
        ]
    lines += [
        "",
        "## Raw metrics",
        "",
        "Each run's `metrics.jsonl` is under `runs/<configuration>-seed<seed>/`; "
        "`results.json` holds this table; `status.json` each run's state.",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    claims_json = [
        {"claim": c.claim, "comparison": c.comparison, "verdict": c.verdict, "note": c.note, "statistics": c.statistics}
        for c in claim_results
    ]
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    if reach is not None:  # seeds as JSON object keys become strings
        (out / "reach.json").write_text(json.dumps(reach, indent=2))
    (out / "claims.json").write_text(json.dumps(claims_json, indent=2))
    return {
        "report": str(out / "report.md"),
        "figures": figures,
        "results": summary,
        "claims": claims_json,
        "reach": reach,
    }
