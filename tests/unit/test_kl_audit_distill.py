"""The exact audit of distillation on a tabular student with a tabular teacher: which recipe's gradient is which KL's,
the combined objective's gradient, and the trainer's verdict (judged on reference problems) agreeing with the
teacher problem's."""

import dataclasses

import pytest
import torch

from megatron_kl.kl.audit.distill import RECIPES, combined_bias, recipe_verdicts, teacher_problem
from megatron_kl.kl.audit.exact import TabularProblem, _quantities, all_configs, audit
from megatron_kl.kl.audit.targets import judge
from megatron_kl.kl.config import UNBIASED_TOL
from megatron_kl.kl.corrections import Correction
from megatron_kl.kl.objective import KLConfig

SEEDS = (0, 1, 2)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_teacher_is_far_from_the_student(seed):
    problem = teacher_problem(seed=seed)
    _, _, _, full_kl, _, _, _ = _quantities(problem)
    assert full_kl.mean() > 0.3  # nats per position: a reference starting at the policy has 0


@pytest.mark.parametrize("seed", SEEDS)
def test_recipes_estimate_the_kls_the_contract_says(seed):
    """On-policy: the exact sequence-level term (Rao-Blackwellised) and k1 with reward-to-go are unbiased for the
    sequence-level KL to the teacher; the exact per-token term and k1 as each token's own reward only for the
    prefix-frozen token-level KL; k3 in the loss for neither reverse KL: its gradient is the token-level FORWARD
    KL(teacher || pi)'s."""
    rows = dict(recipe_verdicts(teacher_problem(seed=seed)))
    by_config = {row.name: row for row in rows.values()}
    for name in ("full-loss-sequence", "k1-reward-token-rtg"):
        assert by_config[name].rel_bias["seq"] < UNBIASED_TOL and by_config[name].rel_bias["token"] > 1e-2
    for name in ("full-loss-token", "k1-reward-token-imm"):
        assert by_config[name].rel_bias["token"] < UNBIASED_TOL and by_config[name].rel_bias["seq"] > 1e-2
    k3 = by_config["k3-loss-token"].rel_bias
    assert k3["forward"] < UNBIASED_TOL and min(k3["seq"], k3["token"]) > 1e-2
    # the exact sequence-level term reaches the same gradient as k1 reward-to-go with less variance per sample
    assert by_config["full-loss-sequence"].variance < by_config["k1-reward-token-rtg"].variance


@pytest.mark.parametrize("seed", SEEDS)
def test_off_policy_samples_need_the_per_decision_weights(seed):
    rows = {row.name: row for row in audit(teacher_problem(seed=seed), True, all_configs(True))}
    unbiased_seq = sorted(name for name, row in rows.items() if row.rel_bias["seq"] < UNBIASED_TOL)
    assert "full-loss-sequence-per_decision" in unbiased_seq
    assert "full-loss-sequence" not in unbiased_seq and "k1-reward-token-rtg" not in unbiased_seq


def test_the_combined_gradient_is_unbiased_exactly_when_both_terms_are():
    student = teacher_problem(seed=4)
    teacher_table = student.reference_table
    reference = dataclasses.replace(student, reference_table=TabularProblem.random(seed=9).reference_table)
    rewards = torch.randn(len(student.sequences), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    unbiased_ref = KLConfig(estimator="k1", placement="reward", coef=0.1)  # reward-to-go
    biased_ref = KLConfig(estimator="k3", placement="loss", coef=0.1)
    for name, term in RECIPES.items():
        seq_unbiased = term.name in ("full-loss-sequence", "k1-reward-token-rtg")
        good = combined_bias(reference, teacher_table, rewards, unbiased_ref, term, 0.2, 0.7)
        assert (good < UNBIASED_TOL) == seq_unbiased, (name, good)
        assert combined_bias(reference, teacher_table, rewards, biased_ref, term, 0.2, 0.7) > 1e-3, name


def test_the_trainers_verdict_agrees_with_the_teacher_problem():
    """distill/biased comes from targets.judge (random reference problems): the same class on a teacher problem."""
    problem = teacher_problem(seed=0)
    correction = Correction("none")
    for config in all_configs(False):
        row = audit(problem, False, [config])[0]
        for target, short in (("sequence_reverse", "seq"), ("token_reverse", "token")):
            verdict = judge(dataclasses.replace(config, target=target), "on_policy", correction)
            assert verdict.unbiased == (row.rel_bias[short] < UNBIASED_TOL), (config.name, target)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_top_k_term_is_unbiased_for_its_own_surrogate_and_biased_for_the_kl(seed):
    """With the teacher known on its top-k of 3 tokens (bucketed rest: k=1, the rest two tokens; renormalised: k=2),
    the sequence-level top-k term's expected gradient is exactly the gradient of E_pi[sum_t D_t] (D_t the top-k
    divergence at the prefix: the surrogate it names) and biased for the KL to the teacher; one more token (the bucket
    then holds one token, the renormalised top-k all three) makes it the exact term."""
    from megatron_kl.distill.config import DistillObjective
    from megatron_kl.kl.audit.exact import _estimator_gradients, top_k_rows

    problem = teacher_problem(seed=seed)
    for tail, k in (("bucket", 1), ("renormalize", 2)):
        term = DistillObjective(estimator="topk", top_k=k, top_k_tail=tail, coef=0.1, aggregation="seq_mean_token_sum")
        grads, q = _estimator_gradients(problem, term, off_policy=False)
        expectation = (q.view(-1, 1, 1) * grads).sum(0)
        lp = problem.log_probs(problem.policy_table).gather(-1, problem.sequences[..., None])[..., 0]
        surrogate = (lp.sum(-1).exp() * top_k_rows(problem, k, tail).sum(-1)).sum()
        (target,) = torch.autograd.grad(surrogate, problem.policy_table, retain_graph=True)
        assert ((expectation - target).norm() / target.norm()).item() < UNBIASED_TOL, tail
        row = audit(problem, False, [term])[0]
        assert row.rel_bias["seq"] > 1e-2 and row.name == f"topk{k}_{tail}-loss-sequence"
        whole = audit(problem, False, [dataclasses.replace(term, top_k=k + 1)])[0]
        assert whole.rel_bias["seq"] < UNBIASED_TOL, tail


def test_the_recipes_table_states_the_top_k_bias():
    from megatron_kl.kl.audit.distill import format_recipes

    verdicts = recipe_verdicts(teacher_problem(seed=0))
    top_k = [(name, row) for name, row in verdicts if row.name.startswith("topk")]
    assert len(top_k) == 2 and all(row.rel_bias["seq"] > 1e-2 for _, row in top_k)
    table = format_recipes(verdicts)
    assert "topk1_bucket-loss-sequence" in table and "no KL (biased for each)" in table
