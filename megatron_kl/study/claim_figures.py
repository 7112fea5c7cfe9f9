"""One figure per claim (``figures/claim{1,2,3}.png``): the groups each claim compares, one column per KL
coefficient (claims 1, 2) or staleness (claim 3). A group's curve is the mean over seeds of the seed's mean over
the group's configurations; the band spans the seeds (min to max)."""

from __future__ import annotations

from pathlib import Path

from megatron_kl.study.series import final
from megatron_kl.study.series import series as metric_series


def _group_curve(groups: dict, names: list[str], key: str):
    """(steps, mean, low, high) over seeds of the per-seed mean over ``names``; None when nothing was logged."""
    per_seed: dict[int, list[dict]] = {}
    for name in names:
        for run in groups[name].finished:
            series = metric_series(run.records, key)
            if series:
                per_seed.setdefault(run.seed, []).append(series)
    if not per_seed:
        return None
    seed_curves = []
    for runs in per_seed.values():
        steps = sorted(set.intersection(*(set(s) for s in runs)))
        seed_curves.append({t: sum(s[t] for s in runs) / len(runs) for t in steps})
    steps = sorted(set.intersection(*(set(c) for c in seed_curves)))
    if not steps:
        return None
    rows = [[c[t] for c in seed_curves] for t in steps]
    return steps, [sum(r) / len(r) for r in rows], [min(r) for r in rows], [max(r) for r in rows]


def _plot(ax, groups, names, key, label, marker=None):
    curve = _group_curve(groups, names, key) if names else None
    if curve is None:
        return
    steps, mean, low, high = curve
    (line,) = ax.plot(steps, mean, label=f"{label} ({len(names)})", marker=marker)
    ax.fill_between(steps, low, high, alpha=0.2, color=line.get_color())


def claim_figures(groups: dict, roles: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    active = {n: r for n, r in roles.items() if r.excluded is None and groups[n].records}
    betas = sorted({r.beta for r in active.values() if r.on_policy and r.biased is not None})
    control = [n for n, r in active.items() if r.on_policy and r.biased is None]
    written = []

    def side(beta, biased):
        return [n for n, r in active.items() if r.on_policy and r.beta == beta and r.biased is biased]

    panels = {
        "claim1.png": (
            "1: on-policy, biased vs unbiased KL gradients - stability",
            [("kl/exact_token", "exact KL / token"), ("optim/grad_norm", "grad norm")],
        ),
        "claim2.png": (
            "2: on-policy, biased vs unbiased KL gradients - performance",
            [("eval/id/pass@1", "in-domain pass@1"), ("eval/ood/pass@1", "OOD pass@1")],
        ),
    }
    for filename, (title, rows) in panels.items():
        if not betas:
            break
        fig, axes = plt.subplots(
            len(rows), len(betas), figsize=(max(6.4, 4.2 * len(betas)), 3.2 * len(rows)), squeeze=False
        )
        for col, beta in enumerate(betas):
            for row, (key, ylabel) in enumerate(rows):
                ax = axes[row][col]
                marker = "." if key.startswith("eval") else None
                _plot(ax, groups, side(beta, False), key, "unbiased", marker)
                _plot(ax, groups, side(beta, True), key, "biased", marker)
                _plot(ax, groups, control, key, "no KL", marker)
                ax.set_title(f"beta = {beta:g}", fontsize=9)
                ax.set_ylabel(ylabel)
                ax.set_xlabel("step")
                ax.legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=90)
        plt.close(fig)
        written.append(str(out / filename))

    stalenesses = sorted({r.staleness for r in active.values() if not r.on_policy})
    if stalenesses:
        rows = [
            ("eval/id/pass@1", "in-domain pass@1"),
            ("optim/grad_norm", "grad norm"),
            ("kl/exact_token", "exact KL / token"),
        ]
        width = max(6.4, 4.2 * len(stalenesses))
        fig, axes = plt.subplots(len(rows), len(stalenesses), figsize=(width, 3.2 * len(rows)), squeeze=False)
        for col, staleness in enumerate(stalenesses):
            here = {n: r for n, r in active.items() if r.staleness == staleness}
            for row, (key, ylabel) in enumerate(rows):
                ax = axes[row][col]
                marker = "." if key.startswith("eval") else None
                _plot(ax, groups, [n for n, r in here.items() if r.biased is None], key, "no KL", marker)
                for beta in sorted({r.beta for r in here.values() if r.biased is not None}):
                    _plot(
                        ax,
                        groups,
                        [n for n, r in here.items() if r.biased is not None and r.beta == beta],
                        key,
                        f"beta = {beta:g}",
                        marker,
                    )
                ax.set_title(f"staleness {staleness}", fontsize=9)
                ax.set_ylabel(ylabel)
                ax.set_xlabel("step")
                ax.legend(fontsize=7)
        fig.suptitle("3: off-policy, with and without a KL term")
        fig.tight_layout()
        fig.savefig(out / "claim3.png", dpi=90)
        plt.close(fig)
        written.append(str(out / "claim3.png"))

    finals = [(n, r) for n, r in roles.items() if groups[n].records]
    if finals:  # final in-domain vs OOD pass@1, one point per run
        fig, ax = plt.subplots(figsize=(5.5, 4.2))
        kinds = {
            "unbiased": lambda r: r.biased is False,
            "biased": lambda r: r.biased is True,
            "no KL / other": lambda r: r.biased is None,
        }
        for label, test in kinds.items():
            points = [
                (final(rec, "eval/id/pass@1"), final(rec, "eval/ood/pass@1"))
                for n, r in finals
                if test(r)
                for rec in groups[n].records
            ]
            points = [(x, y) for x, y in points if x is not None and y is not None]
            if points:
                ax.scatter(
                    [x for x, _ in points],
                    [y for _, y in points],
                    label=f"{label} ({len(points)} runs)",
                    s=14,
                    alpha=0.7,
                )
        ax.set_xlabel("final in-domain pass@1")
        ax.set_ylabel("final OOD pass@1")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "final_id_vs_ood.png", dpi=90)
        plt.close(fig)
        written.append(str(out / "final_id_vs_ood.png"))
    return written
