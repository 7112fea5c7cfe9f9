"""The exact audit on mixed-behaviour responses (partial rollouts): the first tokens sampled by one behaviour policy,
the rest by another. With the behaviour log-probs recorded per token the off-policy corrections stay exact; told one
version for the whole response they are biased."""

import dataclasses
import math

import pytest
import torch

from megatron_kl.kl.audit.exact import RECORDED, TabularProblem, all_configs, audit, behavior_configs
from megatron_kl.kl.corrections import Correction

ZERO = 1e-9
BIASED = 0.02
UNCAPPED = (Correction("sequence_tis", math.inf), Correction("token_tis", math.inf))
# the off-policy rows whose unbiasedness rests on the behaviour log-probs being the sampler's
EXACT_FOR_SEQ = (
    "k1-reward-token-rtg-per_decision",
    "full-loss-sequence-per_decision",
    "k2-loss-sequence-behavior[sequence_tis(uncapped)]",
    "full-loss-sequence-behavior[sequence_tis(uncapped)]",
)
EXACT_FOR_TOKEN = ("k1-loss-token-token_is", "k3-loss-token-token_is", "full-loss-token-behavior[token_tis(uncapped)]")


def _rows(problem):
    rows = audit(problem, True, all_configs(True)) + audit(problem, True, behavior_configs(), corrections=UNCAPPED)
    return {r.name: r for r in rows}


CASES = [(3, 3, 0, 1), (3, 3, 1, 2), (2, 4, 2, 2), (2, 4, 3, 3)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"V{c[0]}T{c[1]}s{c[2]}k{c[3]}")
def mixed(request):
    vocab, length, seed, switch = request.param
    return {
        recorded: _rows(TabularProblem.mixed(vocab, length, seed, switch, recorded)) for recorded in RECORDED
    }, request.param


def _single_table_equivalent(vocab, length, seed, switch) -> TabularProblem:
    """The same sampler as one ordinary behaviour table: every prefix is a state of its own, so the states of
    positions >= switch take their rows from the second policy's table (built independently of ``mixed``)."""
    problem = TabularProblem.mixed(vocab, length, seed, switch)
    later = torch.unique(problem.states[:, switch:])
    table = problem.behavior_table.clone()
    table[later] = problem.second_behavior_table[later]
    return dataclasses.replace(TabularProblem.random(vocab, length, seed), behavior_table=table)


def test_per_token_records_audit_exactly_as_one_behaviour_policy(mixed):
    """The hidden reference: a mixed-behaviour sampler with per-token log-probs is an ordinary (position-dependent)
    behaviour policy, so every row equals the plain off-policy audit of the equivalent single table."""
    by_recording, case = mixed
    plain = _rows(_single_table_equivalent(*case))
    assert plain.keys() == by_recording["per_token"].keys()
    for name, row in by_recording["per_token"].items():
        for target, value in row.rel_bias.items():
            assert value == pytest.approx(plain[name].rel_bias[target], rel=1e-9, abs=1e-12), (name, target)
        assert row.variance == pytest.approx(plain[name].variance, rel=1e-9)
        assert row.mode == "mixed-per_token"


def test_exact_corrections_need_the_per_token_behaviour(mixed):
    """Per-token mu: per-decision weights and the sequence ratio (the product of per-token ratios) stay unbiased for
    the sequence KL, token ratios for the token KL. One version for the whole response: each is biased - except the
    exact KL in the loss with per-decision weights when only the last token is mis-recorded (``first`` with the
    switch at the last position): its weights at position t are the ratios of the tokens before t, so the last
    token's ratio never enters."""
    by_recording, (vocab, length, seed, switch) = mixed
    for name in EXACT_FOR_SEQ:
        assert by_recording["per_token"][name].rel_bias["seq"] < ZERO, name
    for name in EXACT_FOR_TOKEN:
        assert by_recording["per_token"][name].rel_bias["token"] < ZERO, name
    for recorded in ("first", "last"):
        for name in EXACT_FOR_SEQ + EXACT_FOR_TOKEN:
            row = by_recording[recorded][name]
            if recorded == "first" and switch == length - 1 and name == "full-loss-sequence-per_decision":
                assert row.rel_bias["seq"] < ZERO, name
                continue
            assert min(row.rel_bias.values()) > BIASED, (recorded, name)
            assert row.verdict == "biased"


def test_mixed_problems_refuse_a_switch_outside_the_response():
    with pytest.raises(ValueError, match="0 < switch < length=3"):
        TabularProblem.mixed(3, 3, 0, switch=3)
    with pytest.raises(ValueError, match="recorded in"):
        TabularProblem.mixed(3, 3, 0, switch=1, recorded="newest")
