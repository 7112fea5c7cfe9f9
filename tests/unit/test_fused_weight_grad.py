"""vocab_parallel/fused_linear.weight_grad_for_autograd: a 16-bit output weight under megatron DDP gets the fused kernel's
float32 dL/dW added to its float32 main_grad unrounded (megatron's gradient-accumulation fusion), and nothing
through autograd; other weights get the gradient through autograd as before."""

import torch

from megatron_kl.vocab_parallel.fused_linear import weight_grad_for_autograd


def _grad():
    return torch.randn(7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float32) / 3


def test_bf16_weight_with_main_grad_accumulates_the_float32_sum():
    weight = torch.nn.Parameter(torch.zeros(7, 5, dtype=torch.bfloat16))
    weight.main_grad = torch.full((7, 5), 0.25)
    grad = _grad()
    assert weight_grad_for_autograd(weight, grad) is None
    torch.testing.assert_close(weight.main_grad, 0.25 + grad, rtol=0, atol=0)  # exact: no bf16 rounding on the way
    assert (grad.to(torch.bfloat16).float() != grad).any()  # the rounding it avoids is real


def test_other_weights_take_the_autograd_path():
    grad = _grad()
    float32 = torch.nn.Parameter(torch.zeros(7, 5))
    float32.main_grad = torch.zeros(7, 5)
    torch.testing.assert_close(weight_grad_for_autograd(float32, grad), grad, rtol=0, atol=0)
    assert not float32.main_grad.any()
    plain_bf16 = torch.nn.Parameter(torch.zeros(7, 5, dtype=torch.bfloat16))  # no DDP buffer
    out = weight_grad_for_autograd(plain_bf16, grad)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, grad.to(torch.bfloat16), rtol=0, atol=0)
