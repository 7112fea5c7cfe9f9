"""Single-process behaviour of the vocab-parallel functions: clear errors, chunking independence."""

import pytest
import torch

from megatron_kl.vocab_parallel.stats import fused_stats


def test_reference_with_another_tp_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="share the TP layout"):
        fused_stats(torch.randn(2, 3, 8), None, reference_logits=torch.randn(2, 3, 4))


def test_bad_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="temperature"):
        fused_stats(x, None, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_stats(x, None, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_size"):
        fused_stats(x, None, vocab_size=9)


def test_results_do_not_depend_on_chunk_size():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, 33, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(7, 5, 33, generator=g, dtype=torch.float64)
    t = torch.randint(0, 30, (7, 5), generator=g)
    outs = []
    for chunk in (1, 4, 35, None):
        s = fused_stats(x, None, targets=t, reference_logits=ref, vocab_size=30, chunk_size=chunk, temperature=1.3)
        (grad,) = torch.autograd.grad((s.logprobs + s.entropy - s.kl).sum(), x)
        outs.append((s.logprobs, s.entropy, s.kl, grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("block_elements", [40, 100])
def test_row_blocks_inside_a_chunk_do_not_change_results(monkeypatch, block_elements):
    """The elementwise work runs on cache-sized row blocks inside each chunk (CHUNK_ELEMENTS); blocks of
    1-3 rows must give the one-block results, forward and backward, for the logits and fused linear paths."""
    from megatron_kl.vocab_parallel import stats as vocab_parallel
    from megatron_kl.vocab_parallel.fused_linear import fused_linear_grads, fused_linear_stats

    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 33, generator=g, dtype=torch.float64)
    ref = x + 0.1 * torch.randn(9, 33, generator=g, dtype=torch.float64)
    t = torch.randint(0, 30, (9,), generator=g)
    h = torch.randn(9, 8, generator=g, dtype=torch.float64)
    w = torch.randn(33, 8, generator=g, dtype=torch.float64)
    w_ref = w + 0.1 * torch.randn(33, 8, generator=g, dtype=torch.float64)
    weights = torch.rand(3, 9, generator=g, dtype=torch.float64)

    def run():
        xx = x.clone().requires_grad_(True)
        s = fused_stats(xx, None, targets=t, reference_logits=ref, vocab_size=30, chunk_size=5, temperature=0.9)
        loss = (weights[0] * s.logprobs + weights[1] * s.entropy + weights[2] * s.kl).sum()
        (grad,) = torch.autograd.grad(loss, xx)
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        f = fused_linear_stats(
            hh,
            ww,
            None,
            targets=t,
            reference_hidden=h,
            reference_weight=w_ref,
            vocab_size=30,
            chunk_size=5,
            temperature=0.9,
        )
        linear = torch.autograd.grad(
            (weights[0] * f.logprobs + weights[1] * f.entropy + weights[2] * f.kl).sum(), (hh, ww)
        )
        single = fused_linear_grads(
            h,
            w,
            h,
            w_ref,
            t,
            None,
            0.9,
            30,
            5,
            lambda out, lo, hi: (weights[0, lo:hi], weights[1, lo:hi], weights[2, lo:hi]),
        )
        return [s.logprobs, s.entropy, s.kl, grad, f.logprobs, f.entropy, f.kl, *linear, *single]

    one_block = run()
    monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", block_elements)
    assert vocab_parallel.block_rows(33) < 5  # several blocks per chunk
    for a, b in zip(one_block, run()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-12)
