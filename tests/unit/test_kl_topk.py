"""The top-k divergence (megatron_kl.kl.topk) against float64 recomputations from its definition, in the regimes a
run meets: far from the teacher, next to it (judged by relative error), a teacher whose top-k holds all its mass,
logits of 1e4, all-masked rows; and the vocab-parallel statistics at given ids (megatron_kl.vocab_parallel.candidates)
on one rank against torch's own top-k, log-softmax and autograd (their TP=2 results: tests/distributed)."""

import pytest
import torch

from megatron_kl.kl.estimators import ClampCounter
from megatron_kl.kl.topk import top_k_divergence
from megatron_kl.vocab_parallel.candidates import (
    candidate_logits,
    candidate_logprobs,
    fused_candidate_logits,
    top_k_logprobs,
)


def _tables(rows=6, vocab=40, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    teacher = sharp * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    return student.log_softmax(-1), teacher.log_softmax(-1)


def _naive(a, b, tail):
    if tail == "renormalize":
        qa, qb = a.log_softmax(-1), b.log_softmax(-1)
        return (qa.exp() * (qa - qb)).sum(-1)
    rest_a, rest_b = 1 - a.exp().sum(-1), 1 - b.exp().sum(-1)
    return (a.exp() * (a - b)).sum(-1) + rest_a * torch.log(rest_a / rest_b)


def _full_kl(logp, logq):
    return (logp.exp() * (logp - logq)).sum(-1)


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_divergence_matches_its_definition_and_stays_below_the_full_kl(tail, k):
    logp, logq = _tables()
    ids = logq.topk(k, -1).indices
    a, b = logp.gather(-1, ids), logq.gather(-1, ids)
    value = top_k_divergence(a, b, tail)
    assert torch.allclose(value, _naive(a, b, tail), rtol=1e-12, atol=1e-14)
    if tail == "bucket":  # coarse-graining never raises a KL
        assert (value <= _full_kl(logp, logq) + 1e-12).all() and (value > 0).all()


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_a_top_k_holding_the_whole_vocabulary_is_the_full_kl(tail):
    logp, logq = _tables(vocab=12)
    ids = logq.topk(12, -1).indices
    value = top_k_divergence(logp.gather(-1, ids), logq.gather(-1, ids), tail)
    assert torch.allclose(value, _full_kl(logp, logq), rtol=1e-9)


def test_gradient_matches_float64_autograd_of_the_definition():
    logp, logq = _tables(seed=3)
    ids = logq.topk(6, -1).indices
    for tail in ("bucket", "renormalize"):
        a = logp.gather(-1, ids).clone().requires_grad_(True)
        b = logq.gather(-1, ids)
        (grad,) = torch.autograd.grad(top_k_divergence(a, b, tail).sum(), a)
        a2 = a.detach().clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(_naive(a2, b, tail).sum(), a2)
        assert torch.allclose(grad, expected, rtol=1e-10, atol=1e-12), tail


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_next_to_the_teacher_the_error_scales_with_the_divergence(tail):
    """Student = teacher + 1e-4 noise: D ~ 1e-9; float32 inputs give it to 1 % relative error (a formula summing
    O(1) terms before differencing would be off by 100 %)."""
    _, logq = _tables(seed=5)
    g = torch.Generator().manual_seed(9)
    logp = (logq + 1e-4 * torch.randn(logq.shape, generator=g, dtype=torch.float64)).log_softmax(-1)
    ids = logq.topk(8, -1).indices
    a, b = logp.gather(-1, ids), logq.gather(-1, ids)
    reference = top_k_divergence(a.float().double(), b.float().double(), tail)  # the float32 inputs, in float64
    assert reference.max() < 1e-7 and (reference > 0).all()
    value = top_k_divergence(a.float(), b.float(), tail).double()
    assert ((value - reference).abs() / reference).max() < 1e-2


def test_a_teacher_whose_top_k_holds_all_its_mass_is_floored_and_counted():
    b = torch.tensor([[0.0, -80.0, -80.0]], dtype=torch.float64)  # rest ~ exp(-80) * V: below the floor
    a = torch.tensor([[-0.5, -1.5, -2.0]], dtype=torch.float64, requires_grad=True)
    counter = ClampCounter()
    value = top_k_divergence(a, b[:, :3], "bucket", mask=torch.ones(1), counter=counter)
    assert torch.isfinite(value).all() and value.item() > 0
    (grad,) = torch.autograd.grad(value.sum(), a)
    assert torch.isfinite(grad).all()
    assert counter.counts == {"topk_tail": 1}


def test_logits_of_1e4_and_all_masked_rows_stay_finite():
    logits = torch.tensor([[1e4, 1e4 - 3.0, 1e4 - 7.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    teacher = torch.tensor([[1e4 - 1.0, 1e4, 1e4 - 2.0, 5.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    ids, b = top_k_logprobs(teacher, 2, None)
    x = logits.clone().requires_grad_(True)
    sampled = torch.tensor([0, 3])
    logp = x.log_softmax(-1)
    a = candidate_logprobs(
        logp.gather(-1, sampled[:, None])[:, 0], candidate_logits(x, ids, None), x.gather(-1, sampled[:, None])[:, 0]
    )
    expected = logits.double().log_softmax(-1).gather(-1, ids)
    assert torch.allclose(a.double(), expected, atol=1e-5)
    value = top_k_divergence(a, b, "bucket") * torch.tensor([1.0, 0.0])
    (grad,) = torch.autograd.grad(value.sum(), x)
    assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    assert (grad[1] == 0).all()


def test_top_k_log_probs_match_torch_and_skip_the_padding():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 24, generator=g, dtype=torch.float64)
    logits[..., 20:] = 50.0  # padding columns beyond vocab_size=20: never chosen, never in the normaliser
    ids, logprobs = top_k_logprobs(logits, 4, None, temperature=0.7, vocab_size=20)
    reference = (logits[..., :20] / 0.7).log_softmax(-1)
    top = reference.topk(4, -1)
    assert torch.equal(ids, top.indices) and torch.allclose(logprobs, top.values, rtol=1e-12)
    with pytest.raises(ValueError, match="1 <= k"):
        top_k_logprobs(logits, 21, None, vocab_size=20)


def test_candidate_log_probs_and_their_gradient_equal_the_log_softmax():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 30, (2, 6, 4), generator=g)
    sampled = torch.randint(0, 30, (2, 6), generator=g)
    upstream = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    for fused in (False, True):
        logits = hidden @ weight.t()
        logp = (logits / 1.3).log_softmax(-1)
        chosen = logp.gather(-1, sampled[..., None])[..., 0]
        both = torch.cat([ids, sampled[..., None]], -1)
        picked = (
            fused_candidate_logits(hidden, weight, both, None, chunk_rows=5)
            if fused
            else candidate_logits(logits, both, None)
        )
        value = candidate_logprobs(chosen, picked[..., :-1], picked[..., -1], temperature=1.3)
        grads = torch.autograd.grad((value * upstream).sum(), (hidden, weight), retain_graph=True)
        expected_value = logp.gather(-1, ids)
        expected = torch.autograd.grad((expected_value * upstream).sum(), (hidden, weight))
        assert torch.allclose(value, expected_value, rtol=1e-12, atol=1e-12), fused
        for got, want in zip(grads, expected):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), fused
