"""Which configuration reached a target score first (study/reach.py), from runs' evaluation records."""

import pytest

from megatron_kl.study.reach import comparisons, first_step, markdown, reaches


def _run(scores: dict[int, float], last: int = 60) -> list[dict]:
    records = [{"step": s, "eval/id/pass@1": v} for s, v in sorted(scores.items())]
    return records + [{"step": last - 1, "reward/mean": 0.0}]


def test_first_step_is_the_first_evaluation_at_or_above_the_target():
    records = _run({0: 0.3, 10: 0.96, 20: 0.5, 30: 0.97})
    assert first_step(records, "eval/id/pass@1", 0.95) == 10
    assert first_step(records, "eval/id/pass@1", 0.99) is None


def test_ranking_and_paired_differences_with_censored_seeds():
    runs = {
        "slow": {1: _run({0: 0.3, 40: 0.96}), 2: _run({0: 0.3, 50: 0.96}), 3: _run({0: 0.3})},
        "fast": {1: _run({0: 0.3, 10: 0.96}), 2: _run({0: 0.3, 20: 0.96}), 3: _run({0: 0.3, 10: 0.99})},
        "never": {1: _run({0: 0.3}), 2: _run({0: 0.3}), 3: _run({0: 0.3})},
    }
    ranked = reaches(runs, "eval/id/pass@1", 0.95)
    assert [r.configuration for r in ranked] == ["fast", "slow", "never"]
    assert ranked[0].reached == 3 and ranked[1].reached == 2 and ranked[2].median is None
    rows = {row["other"]: row for row in comparisons(ranked)}
    # slow - fast per seed: 30, 30, 60 - 10 = 50 (seed 3 censored at the horizon, step 60)
    assert rows["slow"]["estimate"] == pytest.approx((30 + 30 + 50) / 3)
    assert rows["slow"]["censored"] == 1 and rows["slow"]["low"] <= rows["slow"]["estimate"] <= rows["slow"]["high"]
    text = "\n".join(markdown(ranked, "eval/id/pass@1", 0.95))
    assert "**fast** reached it before **slow**" in text and "censored" in text


def test_nothing_reached_is_said():
    runs = {"a": {1: _run({0: 0.1})}, "b": {1: _run({0: 0.2})}}
    text = "\n".join(markdown(reaches(runs, "eval/id/pass@1", 0.9), "eval/id/pass@1", 0.9))
    assert "No configuration reached the target." in text


def test_final_values_are_compared_paired_by_seed():
    from megatron_kl.study.reach import final_value_comparisons, final_value_markdown

    def kl(value):
        return [{"step": 0, "distill/exact_token": 2.0}, {"step": 9, "distill/exact_token": value}]

    runs = {"exact": {1: kl(1.0), 2: kl(1.2)}, "k1": {1: kl(1.5), 2: kl(1.9)}, "rl": {1: [{"step": 9}], 2: []}}
    rows = final_value_comparisons(runs, "distill/exact_token")
    assert [(r["best"], r["other"]) for r in rows] == [("exact", "k1")]
    assert rows[0]["estimate"] == pytest.approx((0.5 + 0.7) / 2) and rows[0]["low"] <= rows[0]["high"]
    assert "**exact** ended 0.6 below **k1**" in "\n".join(final_value_markdown(rows, "distill/exact_token", "KL"))
