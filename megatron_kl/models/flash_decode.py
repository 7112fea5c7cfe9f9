"""Megatron's flash-decoding mode (``TransformerConfig.flash_decode``) without flash-attn: the two kernels it calls.

Megatron's static-batching KV cache stores keys before RoPE and, at every decode step, rotates every cached key
again (``k_pos_emb[:sequence_end]``) - per layer and step, work that grows with the sequence, plus (on the CPU, for
16-bit models) a float32 copy of the whole cache for the attention kernel. With ``flash_decode=True`` megatron
rotates each new query and key once, at its own position, with precomputed cos/sin tables, and stores rotated keys:
the prefill through ``rope_utils.apply_rotary_emb_flash``, every decode step through
``attention.flash_attn_with_kvcache`` (rotate, append to the cache, attend), both flash-attn kernels. Where
flash-attn is absent (the CPU), :func:`install` provides them:

  rotate_with_cos_sin    flash_attn.layers.rotary.apply_rotary_emb:  x [b, s, h, d], cos/sin [s, r/2]
                         y = x_r cos + rotate_half(x_r) sin on the first r features, the rest unchanged - the
                         operations (and their rounding order in 16-bit) of megatron's ``_apply_rotary_pos_emb_bshd``
                         in the training forward, so the cached keys are bit for bit the keys training computes
  attention_with_kv_cache  flash_attn.flash_attn_with_kvcache: rotate q and the new k at positions n, n+1, ...
                         (n = cache_seqlens, the same for every row in static batching), write k and v into the
                         cache at n, attend q to cache positions < n + s_new (causal: query i to <= n + i)

Rows of different prompt lengths (:func:`ragged_rows`, set by the embedded engine around its decode steps): megatron's
static cache keeps one position for every row (the frame). The engine prefills row i's prompt at frame slots
[0, len_i) and starts every row's decoding at frame slot L = max len: row i's frame slot p >= L holds its true
position p - (L - len_i), and its slots [len_i, L) are a gap. The kernel then rotates each row's new query and key
at its true position and masks the gap out of the attention - each row computes exactly what it computes alone;
megatron's own scheme (prefill the shortest prompt, then one forward per position, forcing the longer prompts'
tokens) costs max len - min len extra forwards per batch.

Attention is computed as :func:`megatron_kl.models.attention.attend` computes it (float32 for 16-bit inputs on
the CPU). The embedded engine may hand megatron a float32 KV cache for 16-bit models (megatron uses a cache that
is already in the inference context): the bf16 keys and values are stored exactly and attention reads them
without a per-step cast.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional

import torch

from megatron_kl.models.attention import attend


def _unset(value) -> bool:
    return value is None or (not isinstance(value, torch.Tensor) and value in (False, 0, 0.0, (-1, -1)))


def rotate_with_cos_sin(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets=0,
    cu_seqlens=None,
    max_seqlen=None,
) -> torch.Tensor:
    """RoPE on ``x [b, s, h, d]`` with ``cos``/``sin [s, r/2]`` or per row ``[b, s, r/2]`` (r <= d rotated
    features), in x's dtype (a new tensor; packed sequences and position offsets are not implemented)."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    if not (_unset(seqlen_offsets) and _unset(cu_seqlens)):
        raise NotImplementedError("rotate_with_cos_sin: seqlen_offsets / cu_seqlens are not implemented")
    rotated = 2 * cos.shape[-1]
    repeat = (lambda t: t.repeat_interleave(2, dim=-1)) if interleaved else (lambda t: torch.cat((t, t), dim=-1))
    # cos/sin [s, r/2] (every row) or [b, s, r/2] (per row) -> [1 or b, s, 1, r]
    cos_, sin_ = (repeat(t.to(x.dtype)).unsqueeze(-2) for t in (cos, sin))
    cos_, sin_ = (t if t.dim() == 4 else t[None] for t in (cos_, sin_))
    x_rot, x_pass = x[..., :rotated], x[..., rotated:]
    return torch.cat(((x_rot * cos_) + (_rotate_half(x_rot, interleaved) * sin_), x_pass), dim=-1)


def attention_with_kv_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    rotary_interleaved: bool = True,
    **unsupported,
) -> torch.Tensor:
    """``q [b, s_new, heads, d]``, caches ``[b, max_len, groups, d]`` (written in place at positions n..n+s_new-1),
    new ``k``/``v [b, s_new, groups, d]`` -> ``[b, s_new, heads, d]`` in q's dtype (flash-attn's contract)."""
    given = sorted(name for name, value in unsupported.items() if not _unset(value))
    if given:
        raise NotImplementedError(f"attention_with_kv_cache: {', '.join(given)} not implemented")
    batch, new = q.shape[0], q.shape[1]
    if cache_seqlens is None:
        start = 0
    else:
        offsets = torch.as_tensor(cache_seqlens).reshape(-1).expand(batch)
        start = int(offsets[0])
        if bool((offsets != start).any()):
            raise NotImplementedError(
                "attention_with_kv_cache: rows at different cache lengths (static batching "
                "keeps one length for every row)"
            )
    end = start + (new if k is not None else 0)
    gaps = _gaps_at(batch, start)
    if rotary_cos is not None:
        # table rows: the new keys at n..n+s_new-1; flash-attn's causal queries there too, otherwise all at n
        keys_at = torch.arange(start, end)
        queries_at = torch.arange(start, start + new) if causal else torch.full((new,), start)
        if gaps is not None:  # [b, s]: each row at its true position, frame slot - its gap
            keys_at, queries_at = (at[None] - gaps[0][:, None] for at in (keys_at, queries_at))
        if k is not None:
            k = rotate_with_cos_sin(k, rotary_cos[keys_at], rotary_sin[keys_at], rotary_interleaved)
        q = rotate_with_cos_sin(q, rotary_cos[queries_at], rotary_sin[queries_at], rotary_interleaved)
    if k is not None:
        k_cache[:, start:end] = k
        v_cache[:, start:end] = v
    keys, values = k_cache[:, :end], v_cache[:, :end]
    mask = None
    if causal and new > 1:  # query i (position start + i) sees keys j <= start + i
        mask = torch.arange(end, device=q.device)[None, :] <= start + torch.arange(new, device=q.device)[:, None]
    if gaps is not None:  # row b skips its gap, frame slots [frame_start - gap_b, frame_start)
        slot = torch.arange(end, device=q.device)[None, :]
        gap, frame_start = gaps[0].to(q.device)[:, None], gaps[1]
        outside = ((slot < frame_start - gap) | (slot >= frame_start))[:, None, None, :]  # [b, 1, 1, end]
        mask = outside if mask is None else outside & mask
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = attend(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale, mask=mask)
    return out.transpose(1, 2).to(q.dtype)


_ragged = threading.local()  # the calling thread's row gaps (the engine decodes in its own thread)


@contextmanager
def ragged_rows(prompt_lengths: torch.Tensor, frame_start: int):
    """Within: decode steps (cache positions >= ``frame_start``) of a batch whose row b's prompt filled frame slots
    [0, prompt_lengths[b]) and whose decoding started for every row at ``frame_start`` (module docstring). The gap
    slots must hold finite values (masked scores still multiply the values: NaN * 0 is NaN)."""
    gaps = frame_start - prompt_lengths.to(torch.long)
    if bool((gaps < 0).any()):
        raise ValueError(f"ragged_rows: a prompt is longer than the frame start {frame_start}")
    previous = getattr(_ragged, "gaps", None)
    _ragged.gaps = (gaps, frame_start) if bool(gaps.any()) else None
    try:
        yield
    finally:
        _ragged.gaps = previous


def _gaps_at(batch: int, start: int):
    """(gaps [b], frame_start) of :func:`ragged_rows` for a call at cache position ``start``, or None."""
    gaps = getattr(_ragged, "gaps", None)
    if gaps is None or start < gaps[1]:
        return None
    if gaps[0].shape[0] != batch:
        raise ValueError(f"ragged_rows holds {gaps[0].shape[0]} rows, the attention call has {batch}")
    return gaps


def install() -> None:
    """Give megatron these kernels where flash-attn does not. Megatron calls them only in flash-decoding mode,
    which only the embedded engine's model turns on."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    if rope_utils.apply_rotary_emb_flash is None:
        rope_utils.apply_rotary_emb_flash = rotate_with_cos_sin
    if attention.flash_attn_with_kvcache is None:
        attention.flash_attn_with_kvcache = attention_with_kv_cache


def uses_cpu_kernels() -> bool:
    """Whether megatron's flash decoding runs through this module's kernels (after :func:`install`)."""
    from megatron.core.transformer import attention

    return attention.flash_attn_with_kvcache is attention_with_kv_cache
