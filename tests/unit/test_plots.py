"""plots/training.png: the reward, the KL terms and the evaluations each on their own labelled axes."""

from megatron_kl.train.plots import training_figure, write_training_plot

RECORDS = [
    {"step": s, "reward/mean": 0.8 + 0.01 * s, "kl/exact_token": 0.001 * s, "kl/k3_token": 0.0009 * s} for s in range(5)
] + [
    {"step": 0, "eval/id/pass@1": 0.9, "eval/ood/pass@1": 0.5},
    {"step": 5, "eval/id/pass@1": 0.95, "eval/ood/pass@1": 0.4},
]


def test_each_quantity_has_its_own_titled_and_labelled_axes(tmp_path):
    fig = training_figure(RECORDS, "run-name")
    reward, kl, evals = fig.axes
    assert fig._suptitle.get_text() == "run-name"
    assert [ax.get_title() for ax in fig.axes] == ["Reward", "KL(policy || reference)", "Evaluation"]
    assert all(ax.get_xlabel() == "RL step" and ax.get_ylabel() for ax in fig.axes)
    assert [line.get_label() for line in reward.lines] == ["mean reward"]
    assert [line.get_label() for line in kl.lines] == ["exact", "k3"]  # the KL apart from the reward's scale
    assert kl.get_ylim()[1] < 0.01 and reward.get_ylim()[0] > 0.5
    assert [line.get_label() for line in evals.lines] == ["in-domain pass@1", "OOD pass@1"]
    path = write_training_plot(RECORDS, tmp_path / "plots", "run-name")
    assert path.endswith("training.png") and (tmp_path / "plots" / "training.png").stat().st_size > 10_000
