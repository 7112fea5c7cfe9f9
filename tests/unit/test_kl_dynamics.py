"""Exact training dynamics (kl/audit/dynamics.py): the one-backward expectation equals the audit's per-sample sum; every
configuration the audit calls unbiased for the sequence-level reverse KL trains to the closed-form optimum pi*
(KL < 1e-8) and every other one does not, on- and off-policy, on two problem shapes."""

import dataclasses
import math

import pytest
import torch

from megatron_kl.kl.audit.dynamics import (
    _kl as kl,
)
from megatron_kl.kl.audit.dynamics import (
    direction,
    dynamics_problem,
    kl_gradient,
    optimum_log_probs,
    optimum_table,
    row_name,
    rpg_configs,
    sequence_log_probs,
    train_exact,
    verdict_of,
)
from megatron_kl.kl.audit.exact import TabularProblem, _estimator_gradients, all_configs, audit, behavior_configs
from megatron_kl.kl.corrections import Correction


@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
def test_one_backward_expectation_equals_the_per_sample_sum(off_policy):
    problem = TabularProblem.random(3, 3, seed=1)
    for cfg in all_configs(off_policy):
        grads, q = _estimator_gradients(problem, cfg, off_policy)
        expected = (q.view(-1, 1, 1) * grads).sum(0)
        got = kl_gradient(problem, cfg, q, off_policy)
        assert (got - expected).norm() <= 1e-12 * max(float(expected.norm()), 1.0), cfg.name


def test_the_optimum_maximises_the_objective():
    problem, rewards = dynamics_problem(3, 2, seed=0)
    beta = 0.5
    ref = sequence_log_probs(problem, problem.reference_table)

    def objective(logp):
        return float((logp.exp() * rewards).sum() - beta * (logp.exp() * (logp - ref)).sum())

    best = objective(optimum_log_probs(problem, rewards, beta))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # any other distribution over the sequences scores lower
        other = torch.log_softmax(ref + rewards / beta + 0.3 * torch.randn(len(ref), generator=g, dtype=ref.dtype), 0)
        assert objective(other) < best


BEHAVIOR = (Correction("sequence_tis", math.inf), Correction("token_tis"))


def _rows(off_policy: bool, behavior: bool = True) -> list:
    """(configuration, behaviour correction) for every KL configuration, every RPG loss and, off-policy (with
    ``behavior``), every configuration with a behaviour correction on its KL term."""
    rows = [(cfg, None) for cfg in all_configs(off_policy) + rpg_configs()]
    return rows + ([(cfg, c) for cfg in behavior_configs() for c in BEHAVIOR] if off_policy and behavior else [])


@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
def test_one_backward_expectation_matches_separate_rows_for_rpg_and_behaviour_corrections(off_policy):
    """The row-scaled expectation equals the audit's per-sample gradients (behaviour corrections) or one
    evaluation per row (RPG losses, which the audit does not enumerate)."""
    problem = TabularProblem.random(3, 2, seed=2)
    table = problem.behavior_table if off_policy else problem.policy_table
    q = sequence_log_probs(problem, table).exp().detach()
    for cfg, correction in _rows(off_policy):
        if cfg.name.startswith("rpg"):
            expected = sum(
                q[n] * kl_gradient(problem, cfg, torch.eye(len(q), dtype=q.dtype)[n], off_policy) for n in range(len(q))
            )
        elif correction is not None:
            grads, weights = _estimator_gradients(problem, cfg, off_policy, correction)
            expected = (weights.view(-1, 1, 1) * grads).sum(0)
        else:
            continue
        got = kl_gradient(problem, cfg, q, off_policy, correction)
        assert (got - expected).norm() <= 1e-12 * max(float(expected.norm()), 1.0), row_name(cfg, correction)


@pytest.mark.parametrize("shape", [(3, 2), (2, 3)], ids=["V3-T2", "V2-T3"])
@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
def test_unbiased_configurations_reach_the_optimum_and_biased_ones_do_not(shape, off_policy):
    """The unbiased ones are trained to pi* (KL < 1e-8); for every other one pi* is not a fixed point of its
    expected direction (|d(pi*)| far from 0), so no run of it can end there, and a short run does not. Every KL
    configuration, every RPG loss and, off-policy, every configuration with a behaviour correction on its KL term
    (on the first shape; the per-row expectation test covers them on another problem)."""
    beta = 0.5
    problem, rewards = dynamics_problem(*shape, seed=0)
    rows = _rows(off_policy, behavior=shape == (3, 2))
    kl_configs = [cfg for cfg, _ in rows if not cfg.name.startswith("rpg")]
    verdicts = {row.name: row.verdict for row in audit(problem, off_policy, list(dict.fromkeys(kl_configs)), BEHAVIOR)}
    verdicts.update({cfg.name: verdict_of(problem, cfg, off_policy) for cfg in rpg_configs()})
    at_optimum = dataclasses.replace(problem, policy_table=optimum_table(problem, rewards, beta).requires_grad_(True))
    assert kl(sequence_log_probs(problem, at_optimum.policy_table), optimum_log_probs(problem, rewards, beta)) < 1e-12
    assert direction(at_optimum, rewards, beta, None).norm() > 1e-2  # beta = 0 (the control) does not stop at pi*
    unbiased = [row_name(*row) for row in rows if "seq" in verdicts[row_name(*row)].split(": ")[-1].split(",")]
    assert unbiased, "no configuration unbiased for the sequence KL: the test is void"
    for cfg, correction in rows:
        name = row_name(cfg, correction)
        stationary = float(direction(at_optimum, rewards, beta, cfg, off_policy, correction).norm())
        if name in unbiased:
            assert stationary < 1e-9, (name, stationary)
            outcome = train_exact(
                problem, rewards, beta, cfg, lr=2.0, steps=4000, off_policy=off_policy, correction=correction
            )
            assert outcome.converged and outcome.kl_to_optimum < 1e-8, outcome
        else:
            assert stationary > 1e-4, (name, verdicts[name], stationary)
            assert (
                train_exact(
                    problem, rewards, beta, cfg, steps=200, off_policy=off_policy, correction=correction
                ).kl_to_optimum
                > 1e-8
            ), name


def test_k1_in_the_loss_is_the_unregularised_reward_maximiser():
    """E[g] = 0 for k1 in the loss: training follows grad E[r] alone, exactly like beta = 0."""
    problem, rewards = dynamics_problem(3, 2, seed=0)
    k1 = next(c for c in all_configs(False) if c.name == "k1-loss-token")
    with_k1 = train_exact(problem, rewards, 0.5, k1, steps=300)
    without = train_exact(problem, rewards, 0.5, None, steps=300)
    assert abs(with_k1.expected_reward - without.expected_reward) < 1e-10
    assert abs(with_k1.kl_to_reference - without.kl_to_reference) < 1e-10


def test_sampled_training_separates_unbiased_and_reward_placed_biased_configurations():
    """With sampled minibatches (the trainer's estimators), the unbiased sequence-level configuration ends near pi*
    on every seed, the biased k3-in-reward drifts past the pre-defined instability bound on every seed."""
    from megatron_kl.kl.audit.dynamics import train_sampled

    problem, rewards = dynamics_problem(3, 2, seed=0)
    configs = {c.name: c for c in all_configs(False)}
    unbiased = train_sampled(problem, rewards, 0.5, configs["full-loss-sequence"], batch=64, steps=400, seeds=2)
    biased = train_sampled(problem, rewards, 0.5, configs["k3-reward-sequence"], batch=64, steps=400, seeds=2)
    assert unbiased.unstable == 0 and max(unbiased.final_kl_to_optimum) < 2e-2, unbiased
    assert biased.unstable == 2 and min(biased.final_kl_to_optimum) > 0.3, biased


def _recording_multinomial(monkeypatch):
    """Record the sampler's sequence probabilities at every step of a dynamics run."""
    seen = []
    real = torch.multinomial

    def record(probs, *args, **kwargs):
        seen.append(probs.detach().clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", record)
    return seen


@pytest.mark.parametrize("staleness", [0, 2])
def test_stale_training_samples_from_the_policy_s_updates_old(monkeypatch, staleness):
    """With train.staleness = s, step t (the policy after t updates) samples from pi_{t-s}, pi_0 = pi_ref while
    t <= s, and from a policy that moved after that."""
    from megatron_kl.kl.audit.dynamics import sequence_log_probs, train_stale

    problem, rewards = dynamics_problem(3, 2, seed=0)
    cfg = {c.name: c for c in all_configs(True)}["k2-loss-sequence"]
    seen = _recording_multinomial(monkeypatch)
    train_stale(problem, rewards, 0.5, cfg, staleness, batch=16, steps=6, lr=1.0, seeds=1)
    reference = sequence_log_probs(problem, problem.reference_table).exp()
    for t, probs in enumerate(seen):
        assert torch.equal(probs, reference) == (t <= staleness), t
    assert len(seen) == 6


def test_stale_training_at_staleness_zero_is_the_on_policy_sampled_run():
    """s = 0 with no correction draws the same minibatches and takes the same steps as on-policy training."""
    from megatron_kl.kl.audit.dynamics import train_sampled, train_stale

    problem, rewards = dynamics_problem(3, 2, seed=0)
    for name in ("k1-reward-token-rtg", "k3-loss-token", None):
        cfg = {c.name: c for c in all_configs(False)}.get(name)
        stale = train_stale(problem, rewards, 0.5, cfg, 0, batch=32, steps=60, seeds=2)
        on_policy = train_sampled(problem, rewards, 0.5, cfg, batch=32, steps=60, seeds=2)
        assert stale.final_kl_to_optimum == pytest.approx(on_policy.final_kl_to_optimum, rel=1e-9, abs=1e-12), name


def test_uncapped_sequence_is_makes_the_stale_reward_gradient_unbiased():
    """In expectation over mu's draws (no baseline), the sequence-IS-corrected reward gradient on stale samples
    equals the exact on-policy gradient of E_pi[r], and the uncorrected one does not."""
    from megatron_kl.kl.audit.dynamics import reward_gradient, token_log_probs
    from megatron_kl.kl.corrections import Correction

    problem, rewards = dynamics_problem(3, 2, seed=4)
    table = problem.policy_table
    mu = token_log_probs(problem, problem.behavior_table)
    logp = token_log_probs(problem, table)
    mask = torch.ones_like(logp, dtype=torch.bool)
    exact = reward_gradient(problem, rewards)
    q = mu.sum(-1).exp()
    for correction, unbiased in ((Correction("sequence_tis", float("inf")), True), (None, False)):
        c = 1.0 if correction is None else correction.weights(logp.detach(), mu, mask)[0]
        (got,) = torch.autograd.grad(((q * rewards)[:, None] * logp * c).sum(), table, retain_graph=True)
        error = float((got - exact).norm() / exact.norm())
        assert (error < 1e-10) == unbiased, (correction, error)


def test_instability_events_are_counted_and_a_stable_run_has_none():
    """The declared event fires on a planted non-finite step (infinite step size), on a reward collapse (uncapped
    sequence IS on samples 16 updates old at step 4: the IS weights' variance throws the policy around), and not
    on the same configuration with small steps."""
    from megatron_kl.kl.audit.dynamics import train_stale
    from megatron_kl.kl.corrections import Correction

    problem, rewards = dynamics_problem(3, 2, seed=0)
    cfg = {c.name: c for c in all_configs(True)}["k2-loss-sequence"]
    stable = train_stale(problem, rewards, 0.5, cfg, 4, batch=64, steps=100, lr=0.5, seeds=2)
    nonfinite = train_stale(problem, rewards, 0.5, cfg, 4, batch=64, steps=10, lr=float("inf"), seeds=2)
    collapse = train_stale(
        problem, rewards, 0.5, cfg, 16, Correction("sequence_tis", float("inf")), batch=64, steps=300, lr=4.0, seeds=2
    )
    assert stable.unstable == 0 and nonfinite.unstable == 2 and collapse.unstable == 2, (stable, nonfinite, collapse)
