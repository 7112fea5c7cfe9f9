"""models/flash_decode.py: the CPU kernels of megatron's flash-decoding mode. RoPE from cos/sin tables equals
megatron's training-forward RoPE bit for bit (so cached keys are the trainer's keys); the KV-cache attention
rotates the new query/key at their positions, writes the cache in place and matches a float64 reference."""

import pytest
import torch

from megatron_kl.megatron_compat import apply_cpu_shims

apply_cpu_shims()

from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402

from megatron_kl.models.flash_decode import attention_with_kv_cache, ragged_rows, rotate_with_cos_sin  # noqa: E402

BATCH, HEADS, GROUPS, DIM, MAX_LEN = 3, 6, 2, 16, 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_rotation_from_tables_equals_megatrons_training_rope(dtype, interleaved, rotary_percent):
    rope = RotaryEmbedding(
        DIM, rotary_percent, rotary_interleaved=interleaved, rotary_base=10000, use_cpu_initialization=True
    )
    positions = 11
    embedding = rope(positions)  # megatron-core moves the frequencies to the GPU here where CUDA exists
    x = (torch.randn(positions, BATCH, HEADS, DIM, generator=torch.Generator().manual_seed(0)) * 30).to(
        embedding.device, dtype
    )
    expected = _apply_rotary_pos_emb_bshd(x, embedding, rotary_interleaved=interleaved)  # [s, b, h, d]
    cos, sin = rope.get_cos_sin(MAX_LEN)
    actual = rotate_with_cos_sin(x.transpose(0, 1), cos[:positions], sin[:positions], interleaved).transpose(0, 1)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    if rotary_percent < 1:
        torch.testing.assert_close(actual[..., DIM // 2 :], x[..., DIM // 2 :], rtol=0, atol=0)


def _rope64(x, positions, rope):
    """float64 RoPE (non-interleaved) of x [b, s, h, d] at integer ``positions``."""
    angles = positions.double()[:, None] * rope.inv_freq.double()[None, :]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def _reference(q, cache_k, cache_v, visible):
    """float64 attention of q [b, s, heads, d] over cache [b, L, groups, d] with visible [s, L]."""
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in (cache_k, cache_v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / DIM**0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)


@pytest.mark.parametrize("new,causal", [(1, False), (4, True), (4, False)], ids=["decode", "causal-chunk", "chunk"])
@pytest.mark.parametrize(
    "dtype,cache_dtype,scale",
    [
        (torch.float32, torch.float32, 1.0),
        (torch.bfloat16, torch.float32, 1.0),
        (torch.bfloat16, torch.bfloat16, 1.0),
        (torch.float32, torch.float32, 20.0),
    ],
    ids=["fp32", "bf16-fp32-cache", "bf16", "large-scores"],
)
def test_kv_cache_attention_matches_float64_reference(new, causal, dtype, cache_dtype, scale):
    rope = RotaryEmbedding(DIM, 1.0, rotary_base=10000, use_cpu_initialization=True)
    cos, sin = rope.get_cos_sin(MAX_LEN)
    g = torch.Generator().manual_seed(1)
    start = 9
    q = (torch.randn(BATCH, new, HEADS, DIM, generator=g) * scale).to(dtype)
    k = (torch.randn(BATCH, new, GROUPS, DIM, generator=g) * scale).to(dtype)
    v = torch.randn(BATCH, new, GROUPS, DIM, generator=g).to(dtype)
    cache_k = torch.randn(BATCH, MAX_LEN, GROUPS, DIM, generator=g).to(cache_dtype)  # positions < start: cached
    cache_v = torch.randn(BATCH, MAX_LEN, GROUPS, DIM, generator=g).to(cache_dtype)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    out = attention_with_kv_cache(
        q,
        cache_k,
        cache_v,
        k,
        v,
        rotary_cos=cos.to(dtype),
        rotary_sin=sin.to(dtype),
        cache_seqlens=torch.full((BATCH,), start, dtype=torch.int32),
        causal=causal,
        rotary_interleaved=False,
    )
    assert out.shape == q.shape and out.dtype == dtype
    end = start + new
    # the cache: rotated new keys and the values written at start..end-1, nothing else touched
    key_positions = torch.arange(start, end)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    expected_k = _rope64(k.double(), key_positions, rope)
    assert ((cache_k[:, start:end].double() - expected_k).abs().max() / expected_k.abs().max()) < tolerance
    torch.testing.assert_close(cache_v[:, start:end], v.to(cache_dtype), rtol=0, atol=0)
    for after, before in ((cache_k, before_k), (cache_v, before_v)):
        torch.testing.assert_close(after[:, :start], before[:, :start], rtol=0, atol=0)
        torch.testing.assert_close(after[:, end:], before[:, end:], rtol=0, atol=0)
    # flash-attn: causal queries at start, start+1, ... see keys <= their position; otherwise all at start, see all
    query_positions = key_positions if causal else torch.full((new,), start)
    visible = torch.arange(end)[None, :] <= (query_positions[:, None] if causal else torch.full((new, 1), end))
    expected = _reference(
        _rope64(q.double(), query_positions, rope), cache_k[:, :end].double(), cache_v[:, :end].double(), visible
    )
    error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert error < tolerance, error


def test_kv_cache_attention_refuses_what_it_does_not_implement():
    q = torch.zeros(2, 1, HEADS, DIM)
    cache = torch.zeros(2, MAX_LEN, GROUPS, DIM)
    new = torch.zeros(2, 1, GROUPS, DIM)
    with pytest.raises(NotImplementedError, match="different cache lengths"):
        attention_with_kv_cache(q, cache, cache.clone(), new, new, cache_seqlens=torch.tensor([3, 4]))
    with pytest.raises(NotImplementedError, match="block_table"):
        attention_with_kv_cache(q, cache, cache.clone(), new, new, block_table=torch.zeros(2, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_rows_decode_each_row_at_its_true_position_and_skip_its_gap(dtype):
    """Under ragged_rows (row b's prompt in frame slots [0, len_b), decoding from slot L for every row): the new
    query and key of row b are rotated at its true position slot - (L - len_b), the gap [len_b, L) is never
    attended - here it holds large finite garbage (the contract: finite; the engine zeroes it), which must not
    leak - and a row without a gap is computed as without the context. float64 reference per row over the row's own keys only."""
    rope = RotaryEmbedding(DIM, 1.0, rotary_base=10000, use_cpu_initialization=True)
    cos, sin = rope.get_cos_sin(MAX_LEN)
    g = torch.Generator().manual_seed(2)
    lengths, frame_start, steps_done = torch.tensor([7, 3, 1]), 7, 2  # two tokens already decoded
    start = frame_start + steps_done
    q = torch.randn(BATCH, 1, HEADS, DIM, generator=g).to(dtype)
    k = torch.randn(BATCH, 1, GROUPS, DIM, generator=g).to(dtype)
    v = torch.randn(BATCH, 1, GROUPS, DIM, generator=g).to(dtype)
    cache_k = torch.randn(BATCH, MAX_LEN, GROUPS, DIM, generator=g)
    cache_v = torch.randn(BATCH, MAX_LEN, GROUPS, DIM, generator=g)
    for b, length in enumerate(lengths.tolist()):  # the gaps hold garbage
        cache_k[b, length:frame_start] = 1e4
        cache_v[b, length:frame_start] = -1e4
    plain_k, plain_v = cache_k.clone(), cache_v.clone()
    args = dict(rotary_cos=cos.to(dtype), rotary_sin=sin.to(dtype), cache_seqlens=start, rotary_interleaved=False)
    with ragged_rows(lengths, frame_start):
        out = attention_with_kv_cache(q, cache_k, cache_v, k, v, **args)
    assert torch.isfinite(out).all()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for b, length in enumerate(lengths.tolist()):
        true = torch.tensor([start - (frame_start - length)])
        expected_k = _rope64(k[b : b + 1].double(), true, rope)
        assert (cache_k[b, start].double() - expected_k[0, 0]).abs().max() / expected_k.abs().max() < tolerance
        own = torch.cat((torch.arange(length), torch.arange(frame_start, start + 1)))  # prompt, then decoded
        expected = _reference(
            _rope64(q[b : b + 1].double(), true, rope),
            cache_k[b : b + 1, own].double(),
            cache_v[b : b + 1, own].double(),
            torch.ones(1, len(own), dtype=torch.bool),
        )
        error = ((out[b : b + 1].double() - expected).abs().max() / expected.abs().max()).item()
        assert error < tolerance, (b, error)
    # row 0 has no gap: exactly what the plain kernel computes for it
    plain = attention_with_kv_cache(q[:1], plain_k[:1], plain_v[:1], k[:1], v[:1], **args)
    torch.testing.assert_close(out[:1], plain, rtol=0, atol=0)
    with ragged_rows(lengths[:2], frame_start), pytest.raises(ValueError, match="2 rows"):
        attention_with_kv_cache(q, cache_k, cache_v, k, v, **args)
    with pytest.raises(ValueError, match="longer than the frame start"), ragged_rows(lengths, 5):
        pass
