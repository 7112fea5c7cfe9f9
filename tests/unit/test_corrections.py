"""Behaviour corrections, GSPO's sequence ratio and Dr. GRPO's aggregation against float64 formulas written out
per token / per sequence here, on random log-probs with ragged lengths, an all-masked row and extreme ratios."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kl.algo.losses import AlgoConfig, Shares, ppo_loss, row_separable
from megatron_kl.config import ConfigError
from megatron_kl.kl.corrections import CORRECTIONS, behavior_weights, mismatch_metrics
from megatron_kl.kl.objective import KLConfig, aggregate_tokens, kl_loss

CAP, LOW, HIGH = 2.0, 0.5, 2.0


def _batch(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    behavior = old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    behavior[0, 1] = old[0, 1] + 30.0  # an extreme ratio (w = e^-30)
    lengths = [7, 5, 1, 0, 3, 6]  # row 3: all masked
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return old, behavior, mask, lengths


def _expected(kind, old, behavior, lengths):
    B, T = old.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        n = lengths[i]
        if n == 0:
            continue
        w = [math.exp(max(-20.0, min(20.0, float(old[i, t] - behavior[i, t])))) for t in range(n)]
        seq = math.prod(w)
        geo = seq ** (1.0 / n)
        for t in range(n):
            out[i, t] = {
                "none": 1.0,
                "tis": min(w[t], CAP),
                "token_tis": min(w[t], CAP),
                "sequence_tis": min(seq, CAP),
                "token_mask": float(LOW <= w[t] <= HIGH),
                "sequence_mask": float(LOW <= seq <= HIGH),
                "geometric_mask": float(LOW <= geo <= HIGH),
                "icepop": w[t] * float(LOW <= w[t] <= HIGH),
            }[kind]
    return out


@pytest.mark.parametrize("kind", CORRECTIONS)
def test_weights_equal_the_per_token_formula(kind):
    old, behavior, mask, lengths = _batch()
    weight, metrics = behavior_weights(kind, old, behavior, mask, CAP, LOW, HIGH)
    expected = _expected(kind, old, behavior, lengths)
    if kind == "none":
        assert weight is None and metrics == {}
        return
    torch.testing.assert_close(weight, expected * mask, rtol=1e-12, atol=1e-12)
    assert not weight.requires_grad and torch.isfinite(weight).all()
    tokens = mask.sum()
    if kind.endswith("mask") or kind == "icepop":
        kept = _expected("icepop" if kind == "icepop" else kind, old, behavior, lengths) != 0
        assert float(metrics["correction/masked_fraction"]) == pytest.approx(
            float(((~kept) & mask.bool()).sum() / tokens)
        )
        assert float(metrics["correction/masked_fraction"]) > 0  # the extreme token/sequence is dropped
    else:
        assert float(metrics["correction/truncated_fraction"]) > 0
        assert float(metrics["correction/masked_fraction"]) == 0
    assert float(metrics["correction/weight_mean"]) == pytest.approx(float(weight.sum() / tokens))


def test_mismatch_metrics_are_kl_of_the_sampler_to_the_policy():
    old, behavior, mask, lengths = _batch(1)
    got = mismatch_metrics(old, behavior, mask)
    pairs = [(float(old[i, t]), float(behavior[i, t])) for i in range(6) for t in range(lengths[i])]
    log_w = [max(-20.0, min(20.0, o - b)) for o, b in pairs]
    assert got["mismatch/k1_token"] == pytest.approx(sum(-x for x in log_w) / len(pairs))
    assert got["mismatch/k3_token"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_w) / len(pairs))
    assert got["is/ratio_min"] == pytest.approx(min(math.exp(x) for x in log_w))
    assert got["is/ratio_max"] == pytest.approx(max(math.exp(x) for x in log_w))


def test_sequence_ratio_is_gspo():
    """loss_i = max(-A s_i, -A clip(s_i, 1-lo, 1+hi)) with s_i = exp(mean_t log pi/pi_old), the same on each of
    the sequence's tokens; gradients equal autograd of that per-sequence formula."""
    old, _, mask, lengths = _batch(2)
    g = torch.Generator().manual_seed(3)
    logprobs = (old + 0.05 * torch.randn(old.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.5], dtype=torch.float64)[:, None].expand_as(old)
    cfg = AlgoConfig(ratio_level="sequence", clip_low=0.01, clip_high=0.02, dual_clip=None)
    per_token, _, ratio = ppo_loss(logprobs, old, adv, mask, cfg)
    got = torch.autograd.grad(per_token.sum(), logprobs)[0]

    lp = logprobs.detach().clone().requires_grad_(True)
    total = 0
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        s = torch.exp((lp[i, :n] - old[i, :n]).mean())
        a = adv[i, 0]
        total = total + n * torch.maximum(-a * s, -a * s.clamp(1 - 0.01, 1 + 0.02))
        assert torch.allclose(ratio[i, :n], s.detach().expand(n))
    want = torch.autograd.grad(total, lp)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (got[mask == 0] == 0).all() and (got.abs().sum(-1)[[i for i, n in enumerate(lengths) if n]] >= 0).all()
    assert not row_separable(KLConfig(), cfg) and row_separable(KLConfig(), AlgoConfig())


def test_dr_grpo_weights_every_token_by_one_over_batch_times_length():
    _, _, mask, lengths = _batch()
    values = torch.zeros_like(mask, requires_grad=True)
    grad = torch.autograd.grad(aggregate_tokens(values, mask, "seq_mean_token_sum_norm", 10.0), values)[0]
    torch.testing.assert_close(grad, mask / (6 * 10.0))  # independent of each sequence's length
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_tokens(values, mask, "seq_mean_token_sum_norm")
    # the KL term uses the same constant, and microbatch shares add up to the minibatch value
    kl = KLConfig(
        estimator="k2",
        placement="loss",
        level="token",
        coef=1.0,
        aggregation="seq_mean_token_sum_norm",
        norm_length=10.0,
    )
    old, behavior, _, _ = _batch(4)
    full = kl_loss(kl, old, behavior, mask)
    shares = Shares(num_sequences=6, num_tokens=float(mask.sum()))
    parts = sum(
        kl_loss(kl, old[s], behavior[s], mask[s]) * shares.factor(kl.aggregation, mask[s])
        for s in (slice(0, 2), slice(2, 6))
    )
    torch.testing.assert_close(parts, full)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"behavior_correction": "seq_tis"}, "algo.behavior_correction"),
        ({"mask_low": 1.2}, "algo.mask_low"),
        ({"ratio_level": "group"}, "algo.ratio_level"),
        ({"norm_length": 0}, "algo.norm_length"),
    ],
)
def test_bad_correction_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AlgoConfig(**kwargs)
