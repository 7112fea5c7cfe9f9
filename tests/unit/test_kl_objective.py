"""KL estimators and objectives: hand-computed values, gradcheck, masking, clamping, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_kl.kl import ClampCounter, KLConfig, kl_loss, kl_shaped_returns

D64 = torch.float64


def _batch(seed=0, b=3, t=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    lp = (-scale * torch.rand(b, t, generator=g, dtype=D64)).requires_grad_(True)
    ref = -scale * torch.rand(b, t, generator=g, dtype=D64)
    beh = -scale * torch.rand(b, t, generator=g, dtype=D64)
    full = torch.rand(b, t, generator=g, dtype=D64).requires_grad_(True)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 1:] = False
    return lp, ref, beh, full, mask


def test_hand_values_token_level():
    lp = torch.tensor([[math.log(0.5), math.log(0.2)]], dtype=D64)
    ref = torch.tensor([[math.log(0.25), math.log(0.4)]], dtype=D64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    d1, d2 = math.log(2.0), math.log(0.5)
    expect = {
        "k1": d1 + d2,
        "k2": 0.5 * d1**2 + 0.5 * d2**2,
        "k3": (0.5 - 1 + d1) + (2.0 - 1 + d2),  # r = ref/pi
    }
    for est, value in expect.items():
        cfg = KLConfig(estimator=est, placement="loss", coef=2.0)
        assert kl_loss(cfg, lp, ref, mask).item() == pytest.approx(2.0 * value, abs=1e-12)
        seq = KLConfig(estimator=est, placement="loss", level="sequence", coef=1.0)
        d = d1 + d2
        assert kl_loss(seq, lp, ref, mask).item() == pytest.approx(
            {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[est], abs=1e-12
        )


def test_hand_values_reward_credit():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=D64)
    mask = torch.tensor([[True, True, False]])
    rewards = torch.tensor([1.0], dtype=D64)
    d = [0.5, -1.0]
    rtg = kl_shaped_returns(KLConfig(coef=0.1), rewards, lp, ref, mask)
    torch.testing.assert_close(rtg, torch.tensor([[1 - 0.1 * (d[0] + d[1]), 1 - 0.1 * d[1], 0.0]], dtype=D64))
    imm = kl_shaped_returns(KLConfig(coef=0.1, credit="immediate"), rewards, lp, ref, mask)
    torch.testing.assert_close(imm, torch.tensor([[1 - 0.1 * d[0], 1 - 0.1 * d[1], 0.0]], dtype=D64))
    seq = kl_shaped_returns(KLConfig(coef=0.1, level="sequence", estimator="k2"), rewards, lp, ref, mask)
    s = 0.5 * (d[0] + d[1]) ** 2
    torch.testing.assert_close(seq, torch.tensor([[1 - 0.1 * s, 1 - 0.1 * s, 0.0]], dtype=D64))
    loss_placed = kl_shaped_returns(KLConfig(placement="loss"), rewards, lp, ref, mask)
    torch.testing.assert_close(loss_placed, torch.tensor([[1.0, 1.0, 0.0]], dtype=D64))
    assert kl_loss(KLConfig(), lp, ref, mask).item() == 0.0  # reward placement adds nothing to the loss


def test_aggregations():
    lp, ref, _, _, mask = _batch()
    d = torch.where(mask, lp - ref, torch.zeros_like(lp)).detach()
    m = mask.to(D64)
    cfg = lambda agg: KLConfig(estimator="k1", placement="loss", coef=1.0, aggregation=agg)  # noqa: E731
    assert kl_loss(cfg("seq_mean_token_sum"), lp, ref, mask).item() == pytest.approx((d.sum() / 3).item())
    assert kl_loss(cfg("token_mean"), lp, ref, mask).item() == pytest.approx((d.sum() / m.sum()).item())
    assert kl_loss(cfg("seq_mean_token_mean"), lp, ref, mask).item() == pytest.approx(
        ((d.sum(-1) / m.sum(-1)).mean()).item()
    )


LOSS_CONFIGS = (
    [
        KLConfig(estimator=e, placement="loss", level=lv, coef=0.5)
        for e in ("k1", "k2", "k3")
        for lv in ("token", "sequence")
    ]
    + [KLConfig(estimator=e, placement="loss", off_policy="token_is", coef=0.5) for e in ("k1", "k2", "k3")]
    + [
        KLConfig(estimator="full", placement="loss", level="token", coef=0.5),
        KLConfig(estimator="full", placement="loss", level="sequence", coef=0.5),
        KLConfig(
            estimator="full", placement="loss", level="sequence", off_policy="per_decision", coef=0.5, truncate=3.0
        ),
    ]
)


@pytest.mark.parametrize(
    "cfg", [c for c in LOSS_CONFIGS if not (c.estimator == "full" and c.level == "sequence")], ids=lambda c: c.name
)
def test_gradcheck_losses(cfg):
    lp, ref, beh, full, mask = _batch(1)
    fn = lambda lp_, full_: kl_loss(cfg, lp_, ref, mask, behavior_logprobs=beh, full_kl=full_)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (lp, full), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("per_decision", [False, True])
def test_rao_blackwellised_gradient_formula(per_decision):
    """Stop-gradient surrogates cannot be gradchecked; check the analytic gradient instead:
    d/d logprob_t = coef/B * sum_{s>t} w_s KL_s and d/d KL_t = coef/B * w_t, w_t = rho_{1:t-1} (or 1)."""
    lp, ref, beh, full, mask = _batch(3)
    cfg = KLConfig(
        estimator="full",
        placement="loss",
        level="sequence",
        coef=0.5,
        off_policy="per_decision" if per_decision else "none",
    )
    loss = kl_loss(cfg, lp, ref, mask, behavior_logprobs=beh, full_kl=full)
    g_lp, g_full = torch.autograd.grad(loss, (lp, full))
    m = mask.to(D64)
    log_rho = ((lp - beh) * m).detach()
    w = torch.exp(log_rho.cumsum(-1) - log_rho) if per_decision else torch.ones_like(lp)
    weighted = (w * full * m).detach()
    future = weighted.flip(-1).cumsum(-1).flip(-1) - weighted
    torch.testing.assert_close(g_lp, 0.5 / 3 * future * m, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_full, 0.5 / 3 * w * m, rtol=1e-12, atol=1e-14)


def test_invalid_configurations_name_the_field():
    cases = [
        (dict(estimator="k4"), "estimator"),
        (dict(placement="advantage"), "placement"),
        (dict(level="batch"), "level"),
        (dict(placement="loss", credit="immediate"), "credit"),
        (dict(off_policy="ppo"), "off_policy"),
        (dict(aggregation="sum"), "aggregation"),
        (dict(coef=-1.0), "coef"),
        (dict(truncate=2.0), "truncate"),
        (dict(placement="loss", estimator="k2", level="sequence", off_policy="token_is"), "off_policy"),
        (dict(placement="loss", estimator="full", off_policy="token_is"), "off_policy"),
        (dict(level="sequence", credit="immediate"), "credit"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=f"KLConfig.{field}"):
            KLConfig(**kwargs)


def test_missing_inputs_are_errors():
    lp, ref, _, _, mask = _batch()
    with pytest.raises(ValueError, match="behavior_logprobs"):
        kl_loss(KLConfig(placement="loss", off_policy="token_is"), lp, ref, mask)
    with pytest.raises(ValueError, match="full_kl"):
        kl_loss(KLConfig(placement="loss", estimator="full"), lp, ref, mask)
    with pytest.raises(ValueError, match="rewards"):
        kl_shaped_returns(KLConfig(), torch.zeros(5, dtype=D64), lp, ref, mask)


ALL_CONFIGS = (
    LOSS_CONFIGS
    + [
        KLConfig(estimator=e, placement="reward", credit=c, coef=0.3)
        for e in ("k1", "k2", "k3", "full")
        for c in ("reward_to_go", "immediate")
    ]
    + [
        KLConfig(estimator="k1", placement="reward", off_policy="per_decision", coef=0.3),
        KLConfig(estimator="k3", placement="reward", level="sequence", coef=0.3),
    ]
)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    pad=st.integers(1, 4),
    scale=st.sampled_from([1.0, 50.0, 1e4]),
    cfg_index=st.integers(0, len(ALL_CONFIGS) - 1),
)
def test_padding_invariance_and_finiteness(seed, pad, scale, cfg_index):
    """Appending padding with garbage (inf/NaN/huge) changes nothing; huge log-ratios stay finite."""
    cfg = ALL_CONFIGS[cfg_index]
    lp, ref, beh, full, mask = _batch(seed, scale=scale)
    rewards = torch.ones(3, dtype=D64)

    def run(lp_, ref_, beh_, full_, mask_):
        counter = ClampCounter()
        loss = kl_loss(cfg, lp_, ref_, mask_, behavior_logprobs=beh_, full_kl=full_, counter=counter)
        returns = kl_shaped_returns(
            cfg, rewards, lp_.detach(), ref_, mask_, behavior_logprobs=beh_, full_kl=full_.detach(), counter=counter
        )
        grads = (None, None)
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, (lp_, full_), allow_unused=True)
        return loss, returns, [g if g is not None else torch.zeros_like(lp_) for g in grads], counter

    loss, returns, grads, counter = run(lp, ref, beh, full, mask)
    garbage = torch.tensor([float("nan"), float("inf"), -1e30, 7.0], dtype=D64)[:pad].expand(3, pad)
    cat = lambda x: torch.cat([x.detach(), garbage], dim=1)  # noqa: E731
    lp2, full2 = cat(lp).requires_grad_(True), cat(full).requires_grad_(True)
    mask2 = torch.cat([mask, torch.zeros(3, pad, dtype=torch.bool)], dim=1)
    loss2, returns2, grads2, _ = run(lp2, cat(ref), cat(beh), full2, mask2)
    if cfg.aggregation == "seq_mean_token_sum":
        torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns2[:, : lp.shape[1]], returns, rtol=1e-12, atol=1e-12)
    assert (returns2[:, lp.shape[1] :] == 0).all()
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g2[:, : lp.shape[1]], g, rtol=1e-12, atol=1e-12)
        assert (g2[:, lp.shape[1] :] == 0).all()
    assert torch.isfinite(loss) and torch.isfinite(returns).all() and all(torch.isfinite(g).all() for g in grads)


def test_clamp_counts_and_bounds():
    lp = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float32, requires_grad=True)
    ref = torch.tensor([[1e4, -1e4, 0.1]], dtype=torch.float32)
    mask = torch.ones(1, 3, dtype=torch.bool)
    counter = ClampCounter()
    loss = kl_loss(KLConfig(estimator="k3", placement="loss", clamp=10.0, coef=1.0), lp, ref, mask, counter=counter)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert counter.as_dict() == {"kl/clamped_k3": 2}
    # d clamped to +-10: k3 = exp(-d) - 1 + d at the clamp, plus the unclamped token
    expect = (math.exp(10) - 1 - 10) + (math.exp(-10) - 1 + 10) + (math.exp(0.1) - 1 - 0.1)
    assert loss.item() == pytest.approx(expect, rel=1e-5)
    # with clamp=None the dtype's safe bound still applies (and is counted)
    counter = ClampCounter()
    loss = kl_loss(KLConfig(estimator="k3", placement="loss", clamp=None, coef=1.0), lp, ref, mask, counter=counter)
    assert torch.isfinite(loss) and counter.as_dict()["kl/clamped_k3"] == 2


def test_names_are_unique_and_readable():
    from megatron_kl.kl.audit.exact import all_configs

    names = [c.name for c in all_configs(True)]
    assert len(names) == len(set(names))
    assert "k1-reward-token-rtg" in names and "full-loss-sequence-per_decision" in names
