"""Behaviour corrections on the KL term (kl.off_policy=behavior), judged by the exact audit, and the declared
objective: kl.target / kl.regime, kl.estimator=auto, kl/biased, kl.strict."""

import dataclasses
import math

import pytest
import torch

from megatron_kl.config import ConfigError
from megatron_kl.kl import KLConfig
from megatron_kl.kl.audit.exact import TabularProblem, all_configs, audit, behavior_configs
from megatron_kl.kl.audit.targets import AXES, candidates, judge, regime_of, select
from megatron_kl.kl.corrections import AUDITED, Correction
from megatron_kl.kl.objective import TARGETS, kl_loss, policy_gradient_surrogate
from megatron_kl.train.checks import kl_verdict, validate_train_config
from megatron_kl.train.config import TrainConfig

ZERO = 1e-9
BIASED = 0.02
UNCAPPED_SEQ = Correction("sequence_tis", math.inf)
UNCAPPED_TOKEN = Correction("token_tis", math.inf)


@pytest.fixture(scope="module", params=[(3, 3, 0), (2, 4, 2), (4, 2, 3)], ids=lambda p: f"V{p[0]}T{p[1]}s{p[2]}")
def problem(request):
    return TabularProblem.random(*request.param)


def _by_name(rows):
    return {r.name: r for r in rows}


def test_on_policy_every_correction_leaves_the_kl_gradient_unchanged(problem):
    """On-policy the sampler is the policy: every weight is 1 and nothing is masked, so each behaviour row
    has exactly the expectation (and variance) of its uncorrected configuration."""
    plain = _by_name(audit(problem, False, all_configs(False)))
    for row in audit(problem, False, behavior_configs()):
        base = plain[row.name.split("-behavior[")[0]]
        for target in TARGETS.values():
            assert abs(row.rel_bias[target] - base.rel_bias[target]) < 1e-12, row.name
        assert row.variance == pytest.approx(base.variance, rel=1e-12), row.name


def test_off_policy_uncapped_importance_weights_carry_on_policy_verdicts(problem):
    """From mu's samples: the untruncated sequence ratio W = pi/mu keeps every on-policy unbiased estimator
    unbiased for its target (E_mu[W g] = E_pi[g]); the untruncated token ratio does so for the per-token
    estimators of the token-level targets (whose states are then mu's)."""
    on_policy = _by_name(audit(problem, False, all_configs(False)))
    rows = _by_name(audit(problem, True, behavior_configs(), corrections=(UNCAPPED_SEQ, UNCAPPED_TOKEN)))
    for name, base in on_policy.items():
        seq_row = rows[f"{name}-behavior[{UNCAPPED_SEQ.label}]"]
        assert (seq_row.rel_bias["seq"] < ZERO) == (base.rel_bias["seq"] < ZERO), name
    for name, target in (
        ("k2-loss-token", "token"),
        ("full-loss-token", "token"),
        ("k1-reward-token-imm", "token"),
        ("k3-loss-token", "forward"),
    ):
        assert on_policy[name].rel_bias[target] < ZERO
        assert rows[f"{name}-behavior[{UNCAPPED_TOKEN.label}]"].rel_bias[target] < ZERO, name
    # the token ratio on reward-to-go credit is the PPO-style weight: biased for the sequence KL
    assert rows[f"k1-reward-token-rtg-behavior[{UNCAPPED_TOKEN.label}]"].rel_bias["seq"] > BIASED


def test_off_policy_truncation_and_masks_bias_the_kl_gradient(problem):
    """With mu far from pi the caps bind: every capped or masked correction is biased for the sequence KL,
    even on the configurations that are unbiased on-policy."""
    capped = tuple(c for c in AUDITED if math.isfinite(c.tis_cap) or not c.kind.endswith("_tis"))
    rows = audit(
        problem,
        True,
        [
            dataclasses.replace(c, off_policy="behavior")
            for c in all_configs(False)
            if c.name in ("k1-reward-token-rtg", "k2-loss-sequence", "full-loss-sequence")
        ],
        corrections=capped,
    )
    assert len(rows) == 3 * len(capped)
    for row in rows:
        assert row.rel_bias["seq"] > BIASED, row.name


def test_caps_that_never_bind_are_exactly_the_uncapped_correction():
    """A sampler close to the policy (every ratio inside [0.5, 2]): the capped and masked corrections equal
    their uncapped form, so sequence TIS at cap 1e3 and sequence masks give the unbiased sequence gradient."""
    problem = TabularProblem.random(3, 3, 4)
    g = torch.Generator().manual_seed(11)
    problem.behavior_table = problem.policy_table.detach() + 0.05 * torch.randn(
        problem.policy_table.shape, generator=g, dtype=torch.float64
    )
    cfg = dataclasses.replace(KLConfig(estimator="k1", placement="reward", coef=0.1), off_policy="behavior")
    rows = audit(
        problem,
        True,
        [cfg],
        corrections=(
            Correction("sequence_tis", 1e3),
            Correction("sequence_mask", 2.0),
            Correction("token_mask"),
            UNCAPPED_SEQ,
        ),
    )
    by = {r.correction: r for r in rows}
    assert by[UNCAPPED_SEQ.label].rel_bias["seq"] < ZERO
    assert by["sequence_tis(cap 1000)"].rel_bias["seq"] < ZERO
    # masks keep every sample here: weight 1, i.e. the uncorrected, biased-off-policy configuration
    plain = audit(problem, True, [KLConfig(estimator="k1", placement="reward", coef=0.1)])[0]
    assert by["sequence_mask[0.5,2]"].rel_bias["seq"] == pytest.approx(plain.rel_bias["seq"], rel=1e-12)
    assert plain.rel_bias["seq"] > 1e-3


def _batch(seed=0, batch=3, length=5):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(batch, length, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    reference = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2] = False  # an all-masked row
    weight = torch.rand(batch, length, generator=g, dtype=torch.float64) * 2
    return logprobs, reference, mask, weight


def test_behavior_weights_multiply_the_kl_integrand():
    """Float64 per-token formulas: loss placement weights each token's k(d_t) (a sequence-level estimate
    by its sequence's mean weight); reward placement weights each token's score term; masked positions
    and all-masked rows contribute nothing, forward and backward."""
    logprobs, reference, mask, weight = _batch()
    m = mask.double()
    d = (logprobs - reference) * m
    cfg = KLConfig(estimator="k3", placement="loss", off_policy="behavior", coef=0.5)
    k3 = torch.exp(-d) - 1 + d
    expected = 0.5 * (weight * k3 * m).sum() / 3
    got = kl_loss(cfg, logprobs, reference, mask, behavior_weight=weight)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(got, logprobs)
    assert torch.all(grad[~mask] == 0)

    seq = dataclasses.replace(cfg, estimator="k2", level="sequence")
    seq_weight = (weight * m).sum(-1) / m.sum(-1).clamp_min(1)
    expected = 0.5 * (seq_weight * 0.5 * d.sum(-1) ** 2).sum() / 3
    torch.testing.assert_close(
        kl_loss(seq, logprobs, reference, mask, behavior_weight=weight), expected, rtol=1e-12, atol=0
    )

    credit = torch.rand(3, 5, dtype=torch.float64)
    reward = KLConfig(estimator="k1", placement="reward", off_policy="behavior", aggregation="token_mean")
    surrogate = policy_gradient_surrogate(reward, logprobs, credit, mask, behavior_weight=weight)
    torch.testing.assert_close(surrogate, (weight * credit * logprobs * m).sum() / m.sum(), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="behavior_weight"):
        kl_loss(cfg, logprobs, reference, mask)


@pytest.mark.parametrize("regime", ["on_policy", "off_policy"])
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize(
    "correction", [Correction(), UNCAPPED_TOKEN, Correction("sequence_tis")], ids=lambda c: c.label
)
def test_auto_picks_the_lowest_variance_unbiased_configuration(target, regime, correction):
    """The choice is unbiased for the target on audit problems it was NOT chosen on (other shapes and seeds),
    and no other unbiased candidate has a lower variance on the selection's problems."""
    template = KLConfig(estimator="auto", target=target, coef=0.02, aggregation="token_mean")
    try:
        chosen, verdict, verdicts = select(template, regime, correction)
    except ValueError as err:  # only where no candidate is unbiased: check that claim
        assert "no configuration is unbiased" in str(err)
        for candidate in candidates(regime, correction):
            concrete = dataclasses.replace(template, **{axis: getattr(candidate, axis) for axis in AXES})
            assert not judge(concrete, regime, correction).unbiased, concrete.name
        return
    assert (chosen.coef, chosen.aggregation, chosen.target) == (0.02, "token_mean", target)
    assert verdict.unbiased and chosen.estimator != "auto"
    assert all(v.variance >= verdict.variance for v in verdicts if v.unbiased)
    for vocab, length, seed in ((3, 3, 7), (2, 4, 8)):
        fresh = TabularProblem.random(vocab, length, seed)
        form = dataclasses.replace(chosen, coef=0.1, aggregation="seq_mean_token_sum")
        row = audit(fresh, regime == "off_policy", [form], corrections=(correction,))[0]
        assert row.rel_bias[TARGETS[target]] < ZERO, (chosen.name, vocab, length, seed)


def test_auto_choices_match_the_documented_ones():
    auto = KLConfig(estimator="auto")
    assert select(auto, "on_policy", Correction())[0].name == "full-loss-sequence"
    assert select(auto, "off_policy", Correction())[0].name == "full-loss-sequence-per_decision"
    forward = dataclasses.replace(auto, target="token_forward")
    assert select(forward, "on_policy", Correction())[0].name == "k3-loss-token"
    assert select(forward, "off_policy", UNCAPPED_TOKEN)[0].name == "k3-loss-token-behavior"
    with pytest.raises(ValueError, match="no configuration is unbiased for kl.target=token_forward.*closest"):
        select(forward, "off_policy", Correction())


def test_regime_follows_staleness_unless_declared():
    assert regime_of(KLConfig(), 0) == "on_policy" and regime_of(KLConfig(), 2) == "off_policy"
    assert regime_of(KLConfig(regime="off_policy"), 0) == "off_policy"
    with pytest.raises(ValueError, match="regime"):
        KLConfig(regime="async")
    with pytest.raises(ValueError, match="target"):
        KLConfig(target="sequence_forward")


def _train_config(*overrides):
    from megatron_kl.train.config import load_train_config

    return load_train_config("configs/cpu/default.yaml", list(overrides))


def test_train_config_resolves_auto_and_judges_the_run():
    cfg = _train_config("kl.estimator=auto", "kl.target=sequence_reverse", "train.staleness=2")
    assert cfg.kl.name == "full-loss-sequence-per_decision" and cfg.kl_selection.unbiased
    assert cfg.kl.aggregation == "token_mean" and cfg.run_name.startswith("full-loss-sequence-per_decision")
    assert kl_verdict(cfg).unbiased
    biased = _train_config("kl.estimator=k3", "kl.placement=loss", "kl.target=sequence_reverse")
    verdict = kl_verdict(biased)
    assert not verdict.unbiased and verdict.rel_bias > BIASED and "BIASED" in verdict.describe()
    assert kl_verdict(_train_config("kl.coef=0")) is None
    # the CPU default declares the target its exact token-level KL is unbiased for
    assert kl_verdict(_train_config()).unbiased
    with pytest.raises(ConfigError, match="no configuration is unbiased"):
        _train_config("kl.estimator=auto", "kl.target=token_forward", "train.staleness=1")


def test_strict_refuses_a_biased_configuration_and_behavior_needs_a_correction():
    strict = _train_config("kl.estimator=k3", "kl.placement=loss", "kl.target=sequence_reverse", "kl.strict=true")
    with pytest.raises(ConfigError, match="kl.strict=true: k3-loss-token: BIASED .*kl.estimator=auto"):
        validate_train_config(strict, strict.model.vocab_size)
    fine = _train_config("kl.estimator=auto", "kl.strict=true")
    validate_train_config(fine, fine.model.vocab_size)
    behavior = _train_config("kl.off_policy=behavior")
    with pytest.raises(ConfigError, match="kl.off_policy=behavior .*algo.behavior_correction"):
        validate_train_config(behavior, behavior.model.vocab_size)
    ok = _train_config("kl.off_policy=behavior", "algo.behavior_correction=icepop", "train.staleness=1")
    assert not kl_verdict(ok).unbiased  # icepop masks: biased, tagged
    assert isinstance(TrainConfig().kl, KLConfig)
