"""``plots/training.png`` of a run: the reward, the KL terms and the evaluations, each on its own axes (the KL, ~1e-3
to 1e-1 nats, would be flat beside a reward of ~0.9), with titles and labelled axes."""

from __future__ import annotations

from pathlib import Path

KL_TERMS = (("kl/exact_token", "exact"), ("kl/k1_token", "k1"), ("kl/k3_token", "k3"))
EVALS = (("eval/id/pass@1", "in-domain pass@1"), ("eval/ood/pass@1", "OOD pass@1"))


def _points(records: list[dict], key: str):
    return [(r["step"], r[key]) for r in records if r.get(key) is not None]


def training_figure(records: list[dict], title: str):
    """The figure: three panels (reward, KL to the reference, evaluation) over the RL step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, kl, evals) = plt.subplots(1, 3, figsize=(13, 3.8))
    fig.suptitle(title, fontsize=10)
    points = _points(records, "reward/mean")
    if points:
        reward.plot(*zip(*points), label="mean reward")
    reward.set(title="Reward", xlabel="RL step", ylabel="mean reward of the step's samples")
    for key, label in KL_TERMS:
        points = _points(records, key)
        if points:
            kl.plot(*zip(*points), label=label)
    kl.set(title="KL(policy || reference)", xlabel="RL step", ylabel="nats per token")
    kl.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for key, label in EVALS:
        points = _points(records, key)
        if points:
            evals.plot(*zip(*points), marker=".", label=label)
    evals.set(title="Evaluation", xlabel="RL step", ylabel="pass@1 (greedy)")
    for ax in (reward, kl, evals):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_training_plot(records: list[dict], out: Path, title: str) -> str:
    """``out/training.png``; a note instead when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "(matplotlib not installed: no plots)"
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig = training_figure(records, title)
    fig.savefig(out / "training.png", dpi=100)
    plt.close(fig)
    return str(out / "training.png")
