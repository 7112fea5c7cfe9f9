"""The exact audit with a truncated sampler mu = trunc(pi): its targets are the gradients of mu's KLs (checked
against central differences of a direct enumeration), with log mu (distribution=truncated) the verdicts for the
sequence and token targets are those of plain on-policy sampling, with log pi (distribution=full) every
configuration is biased."""

import dataclasses
import itertools
import math

import pytest
import torch

from megatron_kl.kl.audit.exact import TabularProblem, all_configs, audit, exact_targets
from megatron_kl.vocab_parallel.truncation import Truncation

ZERO = 1e-9
BIASED = 1e-3
RULES = [Truncation(top_k=2), Truncation(top_p=0.8), Truncation(top_k=3, top_p=0.9)]


def _problem(rule, trained="truncated", seed=0, vocab=4, length=2):
    problem = TabularProblem.random(vocab, length, seed)
    return dataclasses.replace(problem, truncation=rule, trained=trained)


def _sequence_kl(problem, table: torch.Tensor, support: torch.Tensor) -> float:
    """KL(mu || pi_ref) over whole sequences by enumeration, mu = softmax of ``table`` on the fixed ``support``."""
    total = 0.0
    for seq, states in zip(problem.sequences.tolist(), problem.states.tolist()):
        log_ratio, prob = 0.0, 1.0
        for token, state in zip(seq, states):
            if not support[state, token]:
                prob = 0.0
                break
            logits = table[state].masked_fill(~support[state], float("-inf"))
            log_mu = float(torch.log_softmax(logits, -1)[token])
            log_ref = float(torch.log_softmax(problem.reference_table[state], -1)[token])
            prob *= math.exp(log_mu)
            log_ratio += log_mu - log_ref
        total += prob * log_ratio
    return total


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_the_sequence_target_is_the_gradient_of_mus_kl(rule):
    problem = _problem(rule)
    support = problem.support()
    assert bool((support.sum(-1) < problem.vocab).any()), "the rule truncates nothing on this problem"
    target = exact_targets(problem, off_policy=False)["seq"]
    table = problem.policy_table.detach().clone()
    eps = 1e-6
    numeric = torch.zeros_like(table)
    for state, token in itertools.product(range(table.shape[0]), range(table.shape[1])):
        if not support[state, token]:
            continue  # a logit outside the support does not move mu (gradient 0)
        up, down = table.clone(), table.clone()
        up[state, token] += eps
        down[state, token] -= eps
        numeric[state, token] = (_sequence_kl(problem, up, support) - _sequence_kl(problem, down, support)) / (2 * eps)
    torch.testing.assert_close(target, numeric, rtol=1e-5, atol=1e-8)
    assert float(target[~support].abs().max()) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rule", RULES, ids=str)
def test_truncated_log_probs_keep_the_on_policy_verdicts_and_full_ones_lose_them(rule, seed):
    plain = {r.name: r for r in audit(TabularProblem.random(4, 2, seed), False, all_configs(False))}
    truncated = {r.name: r for r in audit(_problem(rule, "truncated", seed), False, all_configs(False))}
    full = {r.name: r for r in audit(_problem(rule, "full", seed), False, all_configs(False))}
    unbiased_somewhere = 0
    for name, row in plain.items():
        for target in ("seq", "token"):
            if row.rel_bias[target] < ZERO:
                unbiased_somewhere += 1
                assert truncated[name].rel_bias[target] < ZERO, (name, target)
                assert full[name].rel_bias[target] > BIASED, (name, target)
            else:
                assert truncated[name].rel_bias[target] > ZERO, (name, target)
        assert math.isnan(truncated[name].rel_bias["forward"])  # KL(pi_ref || mu) is infinite
        assert full[name].verdict in ("biased", "zero expectation"), name
    assert unbiased_somewhere >= 6
