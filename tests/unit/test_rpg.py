"""RPG losses: the two surrogates share their gradient; each divergence's expected gradient is exact."""

import pytest
import torch

from megatron_kl.kl.rpg import DIVERGENCES, RPGConfig, rpg_loss

D64 = torch.float64


def _tokens(seed=0, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(b, t, generator=g, dtype=D64) * 2).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(b, t, generator=g, dtype=D64)
    ref = -torch.rand(b, t, generator=g, dtype=D64) * 2
    adv = torch.randn(b, t, generator=g, dtype=D64)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 4:] = False
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_reinforce_and_differentiable_surrogates_have_the_same_gradient(divergence):
    lp, old, ref, adv, mask = _tokens()
    diff = RPGConfig(
        divergence=divergence, surrogate="differentiable", coef=0.3, clip_low=None, clip_high=None, dual_clip=None
    )
    rein = RPGConfig(
        divergence=divergence, surrogate="reinforce", coef=0.3, clip_low=None, clip_high=None, dual_clip=None
    )
    (g1,) = torch.autograd.grad(rpg_loss(diff, lp, old, ref, adv, mask)[0], lp)
    (g2,) = torch.autograd.grad(rpg_loss(rein, lp, old, ref, adv, mask)[0], lp)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_expected_gradient_equals_divergence_gradient(divergence):
    """One-step policy, samples from pi_old: E_old[grad loss]/beta == grad of the divergence."""
    g = torch.Generator().manual_seed(1)
    vocab = 5
    logits = torch.randn(vocab, generator=g, dtype=D64, requires_grad=True)
    old = torch.log_softmax(torch.randn(vocab, generator=g, dtype=D64), -1)
    ref = torch.log_softmax(torch.randn(vocab, generator=g, dtype=D64), -1)
    logp = torch.log_softmax(logits, -1)
    cfg = RPGConfig(
        divergence=divergence,
        surrogate="differentiable",
        coef=1.0,
        clip_low=None,
        clip_high=None,
        dual_clip=None,
        aggregation="seq_mean_token_sum",
    )
    # every action is one "sequence" of length 1, weighted by pi_old
    expected = torch.zeros(vocab, dtype=D64)
    for a in range(vocab):
        sample_loss, _ = rpg_loss(
            cfg,
            logp[a : a + 1, None],
            old[a : a + 1, None],
            ref[a : a + 1, None],
            torch.zeros(1, 1, dtype=D64),
            torch.ones(1, 1, dtype=torch.bool),
        )
        expected += old[a].exp() * torch.autograd.grad(sample_loss, logits, retain_graph=True)[0]
    p, q = logp.exp(), ref.exp()
    reverse = (p * (logp - ref)).sum()
    forward = (q * (ref - logp)).sum()
    target_obj = reverse if divergence in ("rkl", "urkl") else forward
    (target,) = torch.autograd.grad(target_obj, logits)
    torch.testing.assert_close(expected, target, rtol=1e-10, atol=1e-12)


def test_dual_clip_masks_the_right_tokens():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=D64)).requires_grad_(True)
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.1]], dtype=D64)
    old = lp.detach() - torch.log(ratio)
    ref = lp.detach()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=D64)
    cfg = RPGConfig(divergence="urkl", surrogate="reinforce", coef=0.0, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, metrics = rpg_loss(cfg, lp, old, ref, adv, torch.ones(1, 4, dtype=torch.bool))
    (grad,) = torch.autograd.grad(loss, lp)
    # token 0: A>0, w=1.5>1.28 -> clipped; token 1: A<0, w=0.5<0.8 -> clipped; token 2: A<0, w=5>3 -> dual clip
    assert grad[0, :3].abs().max().item() == 0.0
    assert grad[0, 3].item() == pytest.approx(-1.1 * 1.0 / 4)
    assert metrics["rpg/clip_fraction"].item() == pytest.approx(0.75)


def test_rpg_config_errors():
    with pytest.raises(ValueError, match="RPGConfig.divergence"):
        RPGConfig(divergence="js")
    with pytest.raises(ValueError, match="RPGConfig.dual_clip"):
        RPGConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="clip"):
        RPGConfig(surrogate="differentiable")
    assert RPGConfig().name == "rpg-urkl-reinforce"
