"""models/norm.py: the local spec's RMSNorm saving only x and 1/rms, against a float64 reference (forward and
backward; bf16; activations ~1e4; all-zero and empty rows), equal to torch.nn.RMSNorm, and lean in what it keeps."""

import pytest
import torch

from megatron_kl.models.norm import LeanRMSNorm, use_lean_rms_norm

HIDDEN = 48


def _reference(x, weight, eps):
    x, weight = x.double(), weight.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _relative(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _case(scale, dtype, rows=(5, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, HIDDEN, generator=g, dtype=torch.float64) * scale
    x[0, 0] = 0.0  # an all-zero row: 1/rms = 1/sqrt(eps)
    weight = torch.rand(HIDDEN, generator=g, dtype=torch.float64) + 0.5
    cotangent = torch.randn(*rows, HIDDEN, generator=g, dtype=torch.float64)
    return x.to(dtype), weight.to(dtype), cotangent


@pytest.mark.parametrize("scale", [1.0, 1e4, 1e-3], ids=["unit", "1e4", "small"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_matches_float64_reference_forward_and_backward(scale, dtype, tolerance):
    x, weight, cotangent = _case(scale, dtype)
    norm = LeanRMSNorm(HIDDEN, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    x = x.clone().requires_grad_()
    out = norm(x)
    out.backward(cotangent.to(dtype))
    x64, w64 = x.detach().double().requires_grad_(), weight.double().requires_grad_()
    expected = _reference(x64, w64, 1e-5)
    expected.backward(cotangent)
    assert out.dtype == dtype and x.grad.dtype == dtype and norm.weight.grad.dtype == dtype
    assert _relative(out, expected) < tolerance
    assert _relative(x.grad, x64.grad) < tolerance
    assert _relative(norm.weight.grad, w64.grad) < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_rmsnorm_and_keeps_less(dtype):
    x, weight, cotangent = _case(1.0, dtype, rows=(57, 4))
    torch_norm, lean = torch.nn.RMSNorm(HIDDEN, eps=1e-5).to(dtype), torch.nn.RMSNorm(HIDDEN, eps=1e-5).to(dtype)
    assert use_lean_rms_norm(torch.nn.Sequential(lean)) == 1 and type(lean) is LeanRMSNorm
    outs, grads, kept = [], [], []
    for norm in (torch_norm, lean):
        with torch.no_grad():
            norm.weight.copy_(weight)
        xi = x.clone().requires_grad_()
        kept_bytes = []

        def pack(t, kept_bytes=kept_bytes):
            kept_bytes.append(0 if t is xi or t is norm.weight else t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = norm(xi)
        out.backward(cotangent.to(dtype))
        outs.append(out.detach())
        grads.append((xi.grad, norm.weight.grad))
        kept.append(sum(kept_bytes))
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)
    for mine, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=tolerance * theirs.abs().max().item())
    assert kept[1] == 57 * 4 * 4  # one float32 1/rms per row, besides x and the weight
    assert kept[0] > 57 * 4 * HIDDEN * 4  # torch's composite keeps float32 activation copies


def test_frozen_and_empty_inputs_use_torch():
    norm = LeanRMSNorm(HIDDEN, eps=1e-5)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (HIDDEN,), norm.weight, 1e-5))
    empty = torch.zeros(0, HIDDEN, requires_grad=True)
    out = norm(empty)
    out.sum().backward()
    assert out.shape == (0, HIDDEN) and empty.grad.shape == (0, HIDDEN)


def test_config_names_the_field():
    from megatron_kl.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="model.rms_norm='apex'"):
        ModelConfig(rms_norm="apex").resolved()
