"""Core attention of the pure-PyTorch layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron-core's ``DotProductAttention`` (the local spec's core attention) forms the scores with ``baddbmm``
over keys repeated to every query head and transposed (two copies of the KV cache per layer and call) and
its softmax separately. PyTorch's SDPA computes the same

    out[b, h, i] = sum_j softmax_j(scale * q[b, h, i] . k[b, g(h), j] + mask[i, j]) v[b, g(h), j]

(g(h) = h // (heads / groups), grouped-query attention without the repeat) in one flash-attention kernel
with its own backward. On the CPU 16-bit inputs are computed in float32: the bf16 batched GEMMs at attention's
sizes run ~10x slower than float32 there (decode, 32 rows, 9 heads over 57 positions: 2.9 ms unfused bf16,
0.19 ms SDPA in float32 including the casts); the float32 result is rounded to the model dtype once.

Masks follow megatron's own semantics for ``attention_mask=None``: a causal layer with more than one query
position attends to j <= i (queries and keys the same positions, as megatron asserts); one query position
(a KV-cache decode step) and ``no_mask`` / ``padding`` layers attend to every key given. Everything this
does not cover - an explicit mask tensor, attention bias, packed sequences, sliding windows, softmax
offsets, attention dropout while training - is handed to megatron's implementation unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class LatentDotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` as multi-latent attention's core attention. MLA builds its core attention
    with the key and value head sizes (``k_channels``, ``v_channels``), which only Transformer Engine's attention
    takes; megatron's own computes any query/key size and sizes its output by ``config.kv_channels``, which
    ``ModelConfig.resolved`` sets to the value head size for MLA."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
            raise ValueError(
                f"core attention sized for heads of {self.hidden_size_per_attention_head} values, "
                f"multi-latent attention gives {v_channels}: set kv_channels to the value head size"
            )


class SDPAttention(LatentDotProductAttention):
    """Megatron's ``DotProductAttention`` with its supported cases computed by torch's fused SDPA kernel."""

    def _covered(self, attention_mask, attention_bias, packed_seq_params, mask_type, sq: int, sk: int) -> bool:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            return False
        if self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None:
            return False
        if self.training and self.attention_dropout.p > 0:
            return False
        return not (mask_type == AttnMaskType.causal and sq > 1 and sq != sk)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """query [sq, b, heads, d], key/value [sk, b, groups, d] -> context [sq, b, heads * d]."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, batch = query.size(0), query.size(1)
        if not self._covered(attention_mask, attention_bias, packed_seq_params, mask_type, sq, key.size(0)):
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        # [s, b, n, d] -> [b, n, s, d] views; the kernel takes strided inputs
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        context = attend(q, k, v, scale, is_causal=mask_type == AttnMaskType.causal and sq > 1)
        # contiguous [sq, b, heads, d] (one pass with the cast): a strided one reaches linear_proj, whose
        # torch.matmul does not fold it into one GEMM without autograd but runs a bmm over sq copies of the
        # weight (queries laid out [b, sq] - the embedded engine's prefill: 3.6 ms instead of 0.3 ms per layer)
        context = context.permute(2, 0, 1, 3).to(query.dtype, memory_format=torch.contiguous_format).contiguous()
        return context.view(sq, batch, self.hidden_size_per_partition)


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention is computed in: float32 for 16-bit inputs on the CPU (module docstring), else ``dtype``."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype


def attend(q, k, v, scale: float, is_causal: bool = False, mask=None):
    """softmax(scale q k^T + mask) v for q [b, heads, sq, d], k/v [b, groups, sk, d] (grouped-query attention
    without repeating the keys), computed in :func:`attention_dtype`; the result is in that dtype."""
    dtype = attention_dtype(q.dtype, q.device)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )
