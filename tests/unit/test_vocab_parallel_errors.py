"""Single-process behaviour of the vocab-parallel functions: clear errors, chunking independence."""

import pytest
import torch

from megatron_kl.kl.vocab_parallel import fused_stats


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
