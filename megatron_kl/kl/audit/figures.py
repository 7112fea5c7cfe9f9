"""Figures of the tabular training dynamics (``megatron-kl audit --dynamics --figures DIR``).

``dynamics-exact.png``: KL(pi_t || pi*) against step for every configuration trained with its exact expected
direction, one panel per audit verdict group (unbiased for the sequence KL / another target / biased or zero
expectation), on- and off-policy. ``dynamics-stale.png``: E_pi[r] against step of the stale-sample runs, one panel
per (staleness, correction), the control (beta = 0) and each KL configuration, every seed drawn.
"""

from __future__ import annotations

from pathlib import Path


def _group(verdict: str) -> str:
    if verdict.startswith("unbiased") and "seq" in verdict.split(": ")[-1].split(","):
        return "unbiased for the sequence KL"
    if verdict.startswith("unbiased"):
        return "unbiased for another KL"
    return "biased, zero expectation or no KL"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    """Lay out, write ``out/name`` and close the figure; its path."""
    fig.tight_layout()
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return str(path)


def exact_figure(sections: list[tuple[str, list, dict]], out: Path) -> str:
    """``sections``: (title, DynamicsRows, traces by name) per sampling mode."""
    plt = _pyplot()
    groups = ["unbiased for the sequence KL", "unbiased for another KL", "biased, zero expectation or no KL"]
    fig, axes = plt.subplots(
        len(sections), len(groups), figsize=(4.4 * len(groups), 3.4 * len(sections)), squeeze=False, sharey=True
    )
    for row, (title, rows, traces) in enumerate(sections):
        for col, group in enumerate(groups):
            ax = axes[row][col]
            for r in rows:
                if _group(r.verdict) != group:
                    continue
                trace = [max(v, 1e-16) for v in traces.get(r.outcome.name, [])]
                if trace:
                    ax.plot(range(1, len(trace) + 1), trace, label=r.outcome.name, lw=1)
            ax.set_yscale("log")
            ax.set_title(f"{title}: {group}", fontsize=8)
            ax.set_xlabel("step")
            if col == 0:
                ax.set_ylabel("KL(pi || pi*)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=4, ncol=2)
    return _save(fig, out, "dynamics-exact.png")


def stale_figure(panels: dict, out: Path) -> str:
    """``panels``: (staleness, correction label) -> {configuration name: per-seed E[r] traces}."""
    plt = _pyplot()
    corrections = sorted({c for _, c in panels})
    stalenesses = sorted({s for s, _ in panels})
    fig, axes = plt.subplots(
        len(corrections),
        len(stalenesses),
        figsize=(4.4 * len(stalenesses), 3.2 * len(corrections)),
        squeeze=False,
        sharey=True,
    )
    for i, correction in enumerate(corrections):
        for j, staleness in enumerate(stalenesses):
            ax = axes[i][j]
            for k, (name, seeds) in enumerate(panels.get((staleness, correction), {}).items()):
                for n, trace in enumerate(seeds):
                    ax.plot(
                        range(1, len(trace) + 1),
                        trace,
                        color=f"C{k}",
                        lw=0.8,
                        alpha=0.6,
                        label=name if n == 0 else None,
                    )
            ax.set_title(f"staleness {staleness}, correction {correction}", fontsize=8)
            ax.set_xlabel("step")
            if j == 0:
                ax.set_ylabel("E_pi[r]")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=5)
    return _save(fig, out, "dynamics-stale.png")
