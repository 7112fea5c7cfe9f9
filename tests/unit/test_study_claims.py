"""The study's claims: the paired bootstrap against exact enumeration, verdicts computed from planted effects in
both directions, runs placed by their config, and every arm present in the paper-scale preset."""

import itertools
import random
import statistics
from pathlib import Path

import pytest

from megatron_kl.study.claims import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    Role,
    RunOutcome,
    bootstrap,
    evaluate,
    verdict_of,
)

ROOT = Path(__file__).resolve().parents[2]


def test_bootstrap_interval_matches_exact_enumeration_of_resamples():
    """With 4 seeds there are 4^4 equally likely resamples: their exact 2.5/97.5 % points bound the bootstrap's."""
    per_seed = {1: 0.10, 2: -0.02, 3: 0.05, 4: 0.31}
    means = sorted(statistics.fmean(c) for c in itertools.product(per_seed.values(), repeat=4))
    exact_low, exact_high = means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]
    estimate, low, high = bootstrap(per_seed)
    assert estimate == pytest.approx(statistics.fmean(per_seed.values()), abs=1e-15)
    spread = exact_high - exact_low
    assert abs(low - exact_low) < 0.05 * spread and abs(high - exact_high) < 0.05 * spread
    assert bootstrap({1: 0.2, 2: 0.2, 3: 0.2})[1:] == (pytest.approx(0.2), pytest.approx(0.2))


def test_verdict_follows_the_interval():
    assert verdict_of(0.01, 0.3, 5) == REPRODUCED
    assert verdict_of(-0.3, -0.01, 5) == NOT_REPRODUCED
    assert verdict_of(-0.1, 0.2, 5) == INCONCLUSIVE
    assert verdict_of(0.1, 0.2, 1) == INCONCLUSIVE  # one seed: no interval


ROLES = {
    "unbiased-a": Role(0, 0.1, False),
    "unbiased-b": Role(0, 0.1, False),
    "biased-a": Role(0, 0.1, True),
    "biased-b": Role(0, 0.1, True),
    "unbiased-big": Role(0, 1.0, False),
    "biased-big": Role(0, 1.0, True),
    "control": Role(0, 0.0, None),
    "rpg": Role(0, 0.1, None, excluded="RPG: its own regulariser"),
    "async-no-kl": Role(2, 0.0, None),
    "async-kl": Role(2, 0.1, False),
}


def _outcomes(effect: float, unstable_biased: bool, unstable_no_kl: bool, seeds=range(1, 6)):
    rng = random.Random(0)
    out = []
    for seed in seeds:
        base = 0.5 + 0.05 * rng.random()  # a seed effect shared by every configuration of the seed (pairing)
        for name, role in ROLES.items():
            score = base + rng.uniform(-0.005, 0.005)
            if role.biased is False and role.on_policy:
                score += effect
            unstable = (
                (role.biased is True and unstable_biased) or (name == "async-no-kl" and unstable_no_kl) or name == "rpg"
            )
            out.append(RunOutcome(name, seed, True, unstable, final_id=score, final_ood=score / 2, final_kl=0.1))
    return out


def test_planted_effects_give_the_claims_verdicts_in_both_directions():
    claims = evaluate(_outcomes(effect=0.1, unstable_biased=True, unstable_no_kl=True), ROLES)
    assert [c.verdict for c in claims] == [REPRODUCED, REPRODUCED, REPRODUCED]
    stat = claims[0].statistics["unstable fraction (biased - unbiased)"]
    assert stat["estimate"] == pytest.approx(1.0) and stat["seeds"] == 5  # the RPG run's instability is left out
    in_domain = claims[1].statistics["in-domain pass@1 (unbiased - biased)"]
    assert in_domain["low"] <= in_domain["estimate"] <= in_domain["high"]
    assert in_domain["estimate"] == pytest.approx(0.1, abs=0.01)

    reversed_claims = evaluate(_outcomes(effect=-0.1, unstable_biased=False, unstable_no_kl=False), ROLES)
    assert reversed_claims[1].verdict == NOT_REPRODUCED
    assert reversed_claims[0].verdict == INCONCLUSIVE and "no on-policy run was unstable" in reversed_claims[0].note
    assert (
        reversed_claims[2].verdict == INCONCLUSIVE and "nothing for the KL term to stabilise" in reversed_claims[2].note
    )

    null = evaluate(_outcomes(effect=0.0, unstable_biased=False, unstable_no_kl=False), ROLES)
    assert null[1].verdict == INCONCLUSIVE


def test_failed_seeds_count_as_unstable_and_a_missing_arm_leaves_the_claim_without_seeds():
    outcomes = _outcomes(effect=0.0, unstable_biased=False, unstable_no_kl=False)
    outcomes = [o for o in outcomes if o.configuration != "async-no-kl"]
    outcomes += [RunOutcome("async-no-kl", seed, False, True) for seed in range(1, 6)]
    claims = evaluate(outcomes, ROLES)
    assert claims[2].statistics["unstable fraction (no KL - KL)"]["estimate"] == pytest.approx(1.0)
    roles = {n: r for n, r in ROLES.items() if not n.startswith("async")}
    no_arm = evaluate([o for o in outcomes if o.configuration in roles], roles)
    assert no_arm[2].statistics["unstable fraction (no KL - KL)"]["seeds"] == 0 and no_arm[2].verdict == INCONCLUSIVE


def test_runs_are_placed_by_their_config_and_the_paper_preset_has_every_arm():
    from megatron_kl.constraints import paths_unchecked
    from megatron_kl.study.claims import role_of
    from megatron_kl.study.grid import expand, load_study
    from megatron_kl.train.config import load_train_config as load

    def load_train_config(path, overrides):  # roles only: the studies' model paths are made when they run
        with paths_unchecked():
            return load(path, overrides)

    cpu = load_study(ROOT / "configs" / "study" / "cpu.yaml")
    roles = {c.name: role_of(load_train_config(cpu.base, [*cpu.common, *c.overrides])) for c in cpu.configurations}
    assert roles["k1-reward-rtg-b0.1"] == Role(0, 0.1, False)
    assert roles["k3-loss-token-b1"] == Role(0, 1.0, True)
    assert roles["no-kl"] == Role(0, 0.0, None) and roles["async4-no-kl"] == Role(4, 0.0, None)
    assert len(cpu.seeds) >= 5
    smol = load_study(ROOT / "configs" / "study" / "smollm2-135m.yaml")
    smol_roles = {
        c.name: role_of(load_train_config(smol.base, [*smol.common, *c.overrides])) for c in smol.configurations
    }
    assert {r.biased for r in smol_roles.values()} == {True, False, None} and len(smol.seeds) >= 3

    paper = load_study(
        ROOT / "configs" / "study" / "qwen2.5-7b.yaml",
        ["launch.slurm.account=acct", "launch.slurm.container_image=image"],
    )
    with paths_unchecked():
        runs = expand(paper)
    names = {r.configuration: r.overrides for r in runs}
    paper_roles = {n: role_of(load_train_config(paper.base, o)) for n, o in names.items()}
    outcomes = [RunOutcome(r.configuration, r.seed, True, False, 0.5, 0.4, 0.1) for r in runs]
    for claim in evaluate(outcomes, paper_roles):
        assert all(stat["seeds"] == len(paper.seeds) for stat in claim.statistics.values()), claim.claim


def _claim3_outcomes(no_kl_collapses: bool, kl_spikes: bool, seeds=range(1, 6)):
    """Off-policy runs: without a KL term (collapsed or merely spiking) against a KL term (spiking or not)."""
    out = _outcomes(effect=0.0, unstable_biased=False, unstable_no_kl=False, seeds=seeds)
    out = [o for o in out if not o.configuration.startswith("async")]
    for seed in seeds:
        out.append(
            RunOutcome(
                "async-no-kl", seed, True, True, 0.1 if no_kl_collapses else 0.5, 0.1, 0.1, collapsed=no_kl_collapses
            )
        )
        out.append(RunOutcome("async-kl", seed, True, kl_spikes, 0.5, 0.1, 0.1, collapsed=False))
    return out


def test_claim3_is_decided_by_the_declared_statistic_with_the_other_beside_it():
    # every run spikes, only the runs without a KL term collapse: spike-based inconclusive, severity reproduced
    outcomes = _claim3_outcomes(no_kl_collapses=True, kl_spikes=True)
    by_spikes, by_collapse = evaluate(outcomes, ROLES)[2], evaluate(outcomes, ROLES, "collapsed")[2]
    assert by_spikes.verdict == INCONCLUSIVE and by_collapse.verdict == REPRODUCED
    assert by_spikes.statistics["unstable fraction (no KL - KL)"]["estimate"] == pytest.approx(0.0)
    assert by_spikes.statistics["collapsed fraction (no KL - KL), not in the verdict"]["estimate"] == pytest.approx(1)
    assert by_collapse.statistics["collapsed fraction (no KL - KL)"]["verdict"] == REPRODUCED
    assert "unstable fraction (no KL - KL), not in the verdict" in by_collapse.statistics
    # spikes without collapses: the severity statistic sees nothing to stabilise
    spikes_only = evaluate(_claim3_outcomes(no_kl_collapses=False, kl_spikes=False), ROLES, "collapsed")[2]
    assert spikes_only.verdict == INCONCLUSIVE
    assert spikes_only.statistics["unstable fraction (no KL - KL), not in the verdict"]["verdict"] == REPRODUCED
    # a failed run counts as collapsed
    failed = [o for o in _claim3_outcomes(False, False) if o.configuration != "async-no-kl"]
    failed += [RunOutcome("async-no-kl", seed, False, True) for seed in range(1, 6)]
    assert evaluate(failed, ROLES, "collapsed")[2].verdict == REPRODUCED


def test_a_report_beside_published_verdicts_matches_claims_and_statistics():
    from megatron_kl.study.claims import beside_published

    ours = evaluate(_claim3_outcomes(no_kl_collapses=True, kl_spikes=True), ROLES, "collapsed")
    theirs = evaluate(_claim3_outcomes(no_kl_collapses=True, kl_spikes=True), ROLES, "unstable")
    published = [{"claim": c.claim, "verdict": c.verdict, "statistics": c.statistics} for c in theirs]
    lines = beside_published(ours, published, "published.json")
    table = [line for line in lines if line.startswith("| 3.")]
    verdict_row = next(line for line in table if "**verdict**" in line)
    assert f"| {INCONCLUSIVE} | {REPRODUCED} | no |" in verdict_row  # declared statistics differ: verdicts too
    collapsed_row = next(line for line in table if "| collapsed fraction (no KL - KL) |" in line)
    assert collapsed_row.endswith("| yes |") and "+1.000" in collapsed_row  # matched across the label suffix
    lines = beside_published(ours, published[:2], "published.json")  # a claim the published study lacks
    assert all(line.endswith("| - |") for line in lines if line.startswith("| 3."))


def test_a_study_extends_another_runs_a_subset_and_checks_its_declarations(tmp_path):
    from megatron_kl.config import ConfigError
    from megatron_kl.study.grid import expand, load_study, selected

    cpu = load_study(ROOT / "configs" / "study" / "cpu.yaml")
    assert cpu.claim3_statistic == "collapsed"
    confirm = load_study(ROOT / "configs" / "study" / "cpu-claim3.yaml")
    assert confirm.common == cpu.common and confirm.base == cpu.base and confirm.claim3_statistic == "collapsed"
    assert {c.name for c in selected(confirm)} == {c.name for c in cpu.configurations if c.name.startswith("async4")}
    assert not set(confirm.seeds) & set(range(1, 6))  # seeds never used to design the statistic
    replication = load_study(ROOT / "configs" / "study" / "cpu-replication.yaml")
    assert [c.name for c in selected(replication)] == [c.name for c in cpu.configurations]
    assert not set(replication.seeds) & set(cpu.seeds) and Path(replication.published).is_file()
    assert len(expand(replication)) <= 48  # the preset's promise: under 30 minutes on 2 cores at ~25 s a run

    base = tmp_path / "a.yaml"
    base.write_text("name: a\nbase: configs/cpu/default.yaml\noutput_dir: x\nconfigurations: [{name: one}]\n")
    for text, message in (
        ("extends: a.yaml\nname: b\nonly: [two*]\n", "matches no configuration"),
        ("extends: a.yaml\nclaim3_statistic: spikes\n", "claim3_statistic"),
        ("extends: missing.yaml\n", "is not a file"),
        ("extends: b.yaml\n", "cycle"),
        ("extends: a.yaml\npublished: none.json\n", "published="),
    ):
        (tmp_path / "b.yaml").write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_study(tmp_path / "b.yaml")


def test_a_claim_without_runs_to_pair_says_it_was_not_tested():
    off_policy_only = {n: r for n, r in ROLES.items() if n.startswith("async")}
    outcomes = [o for o in _claim3_outcomes(True, True) if o.configuration in off_policy_only]
    claims = evaluate(outcomes, off_policy_only, "collapsed")
    assert [c.note.startswith("not tested") for c in claims] == [True, True, False]
    assert claims[2].verdict == REPRODUCED
