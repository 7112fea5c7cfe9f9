"""models/attention.py (torch SDPA as the local spec's core attention) against a float64 reference written
out here, forward and backward: causal prefill, KV-cache decode steps (one query over many keys), no-mask,
grouped-query attention, 16-bit inputs, logits-scale inputs; and the cases it hands to megatron-core's
DotProductAttention unchanged. The whole-model comparison with megatron's attention (logits, gradients,
updated weights) is in megatron_kl/validation/test_model_layouts.py."""

import types

import pytest
import torch

from megatron_kl.megatron_compat import apply_cpu_shims

apply_cpu_shims()

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from megatron_kl.models.attention import SDPAttention  # noqa: E402

HEADS, GROUPS, DIM = 6, 2, 8
# megatron's DotProductAttention computes where its score buffer lives: the current GPU where CUDA exists
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
SINGLE_RANK = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))


def _build(cls, mask_type=AttnMaskType.causal, dtype=torch.float32):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
    )
    if cls is DotProductAttention and parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()  # its score buffer (model-parallel init makes it)
    tracker = tensor_parallel.get_cuda_rng_tracker()  # its dropout region forks this RNG (the CPU tracker here)
    if cls is DotProductAttention and "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 0)
    return cls(config, layer_number=1, attn_mask_type=mask_type, attention_type="self", pg_collection=SINGLE_RANK)


def _reference(query, key, value, causal: bool):
    """float64: softmax(q k^T / sqrt(d) + mask) v with key/value group g(h) = h // (HEADS / GROUPS)."""
    q, k, v = (t.double() for t in (query, key, value))
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in (k, v))
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) / DIM**0.5
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), v)
    return out.reshape(out.shape[0], out.shape[1], HEADS * DIM)


def _inputs(sq, sk, batch=3, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(sq, batch, HEADS, DIM, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    k = (torch.randn(sk, batch, GROUPS, DIM, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    v = torch.randn(sk, batch, GROUPS, DIM, generator=g).to(DEVICE, dtype).requires_grad_()
    return q, k, v


def _relative(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize(
    "sq,sk,mask_type,scale",
    [
        (7, 7, AttnMaskType.causal, 1.0),  # prefill / training: causal, queries and keys the same positions
        (1, 9, AttnMaskType.causal, 1.0),  # KV-cache decode step: one query attends to every cached key
        (5, 5, AttnMaskType.no_mask, 1.0),
        (6, 6, AttnMaskType.causal, 30.0),
    ],  # scores ~1e3 (q.k ~ 900 * 8 / sqrt(8))
    ids=["causal", "decode", "no-mask", "large-scores"],
)
def test_matches_float64_reference_forward_and_backward(sq, sk, mask_type, scale):
    attention = _build(SDPAttention, mask_type)
    q, k, v = _inputs(sq, sk, scale=scale)
    out = attention(q, k, v, None)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _reference(q64, k64, v64, causal=mask_type == AttnMaskType.causal and sq > 1)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert _relative(out, expected) < 1e-5
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    out.backward(cotangent.float())
    expected.backward(cotangent)
    # Flash attention's backward recomputes the probabilities from the saved log-sum-exp: with scores ~1e3 the
    # float32 gradients of q and k carry ~2e-3 of their largest entry (measured 1.7e-3 / 3.7e-3; megatron's
    # unfused backward 1.5e-4 / 4.5e-4) - the same kernel family as Transformer Engine's on GPUs.
    tolerance = 1e-2 if scale > 10 else 1e-5
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert _relative(got, want) < tolerance


def test_bf16_inputs_are_computed_in_float32_on_the_cpu():
    """bf16 in, bf16 out, one rounding: within bf16's precision of the float64 result, and no less accurate
    than megatron's unfused bf16 path (bf16 scores and probabilities)."""
    if DEVICE.type == "cuda":
        pytest.skip("16-bit attention runs in its own dtype on a GPU (attention_dtype)")
    sdpa = _build(SDPAttention, dtype=torch.bfloat16)
    unfused = _build(DotProductAttention, dtype=torch.bfloat16)
    for sq, sk in ((1, 33), (9, 9)):
        q, k, v = _inputs(sq, sk, dtype=torch.bfloat16, seed=sq)
        expected = _reference(q, k, v, causal=sq > 1)
        out = sdpa(q, k, v, None, attn_mask_type=AttnMaskType.no_mask if sq == 1 else None)
        assert out.dtype == torch.bfloat16
        error = _relative(out, expected)
        assert error < 2**-8
        assert error <= _relative(unfused(q, k, v, None), expected) + 2**-9


def test_empty_batch():
    attention = _build(SDPAttention)
    q, k, v = _inputs(4, 4, batch=0)
    assert attention(q, k, v, None).shape == (4, 0, HEADS * DIM)


def test_explicit_mask_is_handed_to_megatron():
    """An attention_mask tensor (True = masked) is megatron's to apply: the output is DotProductAttention's."""
    sdpa, unfused = _build(SDPAttention), _build(DotProductAttention)
    q, k, v = _inputs(5, 5)
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool, device=DEVICE)
    mask[..., 3] = True  # nobody attends to position 3
    out = sdpa(q, k, v, mask, attn_mask_type=AttnMaskType.padding)
    torch.testing.assert_close(out, unfused(q, k, v, mask, attn_mask_type=AttnMaskType.padding), rtol=0, atol=0)
    keep = torch.tensor([0, 1, 2, 4], device=DEVICE)
    expected = _reference(q, k[keep], v[keep], causal=False)
    assert _relative(out, expected) < 1e-5


def test_layer_uses_sdpa_only_when_configured():
    from megatron_kl.config import ConfigError, ModelConfig
    from megatron_kl.models.builder import have_transformer_engine, layer_spec

    if have_transformer_engine():
        pytest.skip("the Transformer Engine spec has its own fused attention")

    def chosen(**fields):
        return layer_spec(ModelConfig(**fields)).submodules.self_attention.submodules.core_attention

    assert chosen(core_attention="sdpa") is SDPAttention and chosen(core_attention="unfused") is DotProductAttention
    # auto: SDPA for 16-bit models, megatron's kernel in float32
    assert chosen(params_dtype="bfloat16") is SDPAttention and chosen(params_dtype="float32") is DotProductAttention
    assert chosen(core_attention="sdpa", params_dtype="float32") is SDPAttention
    with pytest.raises(ConfigError, match="model.core_attention='flash'"):
        ModelConfig(core_attention="flash").resolved()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_major_queries_give_a_contiguous_context(dtype):
    """Queries stored batch-major ([b, s] in memory, as megatron lays out the embedded engine's prefill): the
    context equals the sequence-major call's bit for bit and comes back contiguous [s, b, h] - a strided one
    makes linear_proj's matmul (without autograd) a bmm over s copies of its weight instead of one GEMM."""
    attention = _build(SDPAttention, dtype=dtype)
    q, k, v = (t.detach() for t in _inputs(6, 6, batch=4, dtype=dtype))
    batch_major = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)]
    assert not batch_major[0].is_contiguous()
    with torch.no_grad():
        out = attention(*batch_major, None)
        expected = attention(q, k, v, None)
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert _relative(out, _reference(q, k, v, causal=True)) < (2**-8 if dtype == torch.bfloat16 else 1e-5)
