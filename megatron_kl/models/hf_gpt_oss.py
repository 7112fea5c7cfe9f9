"""Hugging Face ``GptOssForCausalLM`` <-> Megatron GPTModel (the parts that differ from the Llama / Qwen mapping of
:mod:`megatron_kl.models.hf`).

Layer i (prefix ``model.layers.i.`` / ``decoder.layers.i.``):

    self_attn.{q,k,v}_proj.{weight,bias}   self_attention.linear_qkv.{weight,bias} (as Qwen2's)
    self_attn.o_proj.{weight,bias}         self_attention.linear_proj.{weight,bias}
    self_attn.sinks                        self_attention.core_attention.softmax_offset (megatron's learnable offset)
    mlp.router.{weight,bias}               mlp.router.{weight,bias}
    mlp.experts.gate_up_proj [E, H, 2I]    expert j: mlp.experts.local_experts.j.linear_fc1.weight [2I, H] =
                                           [gate; up] with gate = gate_up_proj[j][:, 0::2]^T, up = [:, 1::2]^T
    mlp.experts.gate_up_proj_bias [E, 2I]  ...linear_fc1.bias = [b[0::2]; b[1::2]]
    mlp.experts.down_proj [E, I, H]        ...linear_fc2.weight = down_proj[j]^T
    mlp.experts.down_proj_bias [E, H]      ...linear_fc2.bias

The experts are stored fused: a Megatron expert is read as its row of the fused tensors (a safetensors slice, never
the whole layer), and on export each layer's experts are gathered and written fused again (:class:`ExpertFuser`).
The expert MLP is (up + 1) * gate * sigmoid(1.702 gate), gate clamped to <= limit and up to [-limit, limit]:
megatron's gated MLP with ``quick_gelu``, ``glu_linear_offset`` 1 and ``activation_func_clamp_value`` = limit.
Checkpoints quantised to MXFP4 (the published gpt-oss weights) are refused: dequantise them to bf16 first.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

import torch

from megatron_kl.config import ConfigError, ModelConfig, MoEConfig
from megatron_kl.models.hf_rope import yarn_from_hf, yarn_to_hf

MODEL_TYPE = "gpt_oss"
HF_CLASS = "GptOssForCausalLM"
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu
_FUSED = {
    "linear_fc1.weight": "gate_up_proj",
    "linear_fc1.bias": "gate_up_proj_bias",
    "linear_fc2.weight": "down_proj",
    "linear_fc2.bias": "down_proj_bias",
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_LAYERED_EXPERT = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$"
)
_PLAIN = {
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    "mlp.router.bias": "mlp.router.bias",
    "mlp.router.weight": "mlp.router.weight",
}


def layer_hf_names(suffix: str) -> Optional[list[str]]:
    """The HF suffixes (within ``model.layers.i.``) of a GPT-OSS-specific Megatron suffix; None for the rest. A routed
    expert's tensor names the fused tensor it is a row of (:func:`expert_of`)."""
    if suffix in _PLAIN:
        return [_PLAIN[suffix]]
    match = _EXPERT.match(suffix)
    if match:
        return [f"mlp.experts.{_FUSED[match.group(2)]}"]
    return None


def expert_of(suffix: str) -> Optional[tuple[int, str]]:
    """(expert index, megatron kind) of a routed expert's suffix; None for other tensors."""
    match = _EXPERT.match(suffix)
    return (int(match.group(1)), match.group(2)) if match else None


def expert_to_megatron(kind: str, row: torch.Tensor) -> torch.Tensor:
    """Expert j's Megatron tensor from its row of the fused HF tensor."""
    if kind == "linear_fc1.weight":  # [H, 2I] interleaved columns -> [gate; up] rows
        return torch.cat([row[:, 0::2].t(), row[:, 1::2].t()], dim=0).contiguous()
    if kind == "linear_fc1.bias":
        return torch.cat([row[0::2], row[1::2]]).contiguous()
    if kind == "linear_fc2.weight":
        return row.t().contiguous()
    return row


def expert_to_hf(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`expert_to_megatron`: the expert's row of the fused HF tensor."""
    if kind in ("linear_fc1.weight", "linear_fc1.bias"):
        gate, up = torch.chunk(tensor, 2, dim=0)
        fused = torch.stack([gate, up], dim=1).reshape(-1, *tensor.shape[1:])  # rows g0, u0, g1, u1, ...
        return (fused.t() if kind == "linear_fc1.weight" else fused).contiguous()
    if kind == "linear_fc2.weight":
        return tensor.t().contiguous()
    return tensor


class ExpertFuser:
    """Collects a layer's experts from a stream of Megatron full-layout tensors and yields each fused HF tensor once
    all ``num_experts`` rows are in (one layer's experts held at a time)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.rows: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def add(self, megatron_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        match = _LAYERED_EXPERT.match(megatron_name)
        layer, expert, kind = int(match.group(1)), int(match.group(2)), match.group(3)
        rows = self.rows.setdefault((layer, kind), {})
        rows[expert] = expert_to_hf(kind, tensor)
        if len(rows) == self.num_experts:
            del self.rows[(layer, kind)]
            yield (
                f"model.layers.{layer}.mlp.experts.{_FUSED[kind]}",
                torch.stack([rows[j] for j in range(self.num_experts)]),
            )

    def check_done(self) -> None:
        if self.rows:
            raise ValueError(f"export ended with incomplete expert layers {sorted(self.rows)}")


# ---------------------------------------------------------------------------------------------- configs


def _window(hf: dict) -> tuple[Optional[int], Optional[int]]:
    """(sliding_window, full_attention_every) of HF ``layer_types``: every layer windowed, or a full layer every
    N-th layer (N-1 windowed layers, then a full one), which is what megatron-core's window_attn_skip_freq builds."""
    types = hf.get("layer_types") or ["sliding_attention"] * hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    if "sliding_attention" not in types or window is None:
        return None, None
    full = [i + 1 for i, t in enumerate(types) if t == "full_attention"]
    if not full:
        return int(window), None
    every = full[0]
    if any(t not in ("sliding_attention", "full_attention") for t in types) or full != list(
        range(every, len(types) + 1, every)
    ):
        raise ConfigError(
            f"config.json layer_types={types}: megatron-core builds a full-attention layer every N-th "
            "layer (the rest windowed) only"
        )
    return int(window), every


def model_config_values(hf: dict, rope: dict) -> dict:
    """ModelConfig fields of a gpt_oss config.json (``rope``: its RoPE parameters, either style)."""
    if hf.get("quantization_config"):
        raise ConfigError(
            f"config.json quantization_config={hf['quantization_config'].get('quant_method')!r}: the "
            "weights are quantised; convert a bf16 checkpoint (dequantise the MXFP4 experts first)"
        )
    if not hf.get("attention_bias", True):
        raise ConfigError(
            "config.json attention_bias=false: GPT-OSS's experts and router carry biases, which "
            "megatron-core adds with the attention output's (add_bias_linear) only together"
        )
    alpha = float(hf.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if abs(alpha - QUICK_GELU_ALPHA) > 1e-9:
        raise ConfigError(
            f"config.json swiglu_alpha={alpha}: megatron-core's quick_gelu fixes it to {QUICK_GELU_ALPHA}"
        )
    window, every = _window(hf)
    heads = hf["num_attention_heads"]
    experts = int(hf["num_local_experts"])
    return dict(
        architecture=MODEL_TYPE,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", 150000.0)),
        yarn=yarn_from_hf(rope, hf.get("max_position_embeddings", 4096), "GPT-OSS"),
        norm_epsilon=hf.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True,
        qk_layernorm=False,
        attention_sinks=True,
        sliding_window=window,
        full_attention_every=every,
        linear_bias=True,
        glu_activation="quick_gelu",
        glu_up_offset=1.0,
        glu_clamp=float(hf.get("swiglu_limit", 7.0)),
        moe=MoEConfig(
            num_experts=experts,
            router_topk=int(hf["num_experts_per_tok"]),
            ffn_hidden_size=int(hf["intermediate_size"]),
            normalize_topk=True,
            aux_loss_coeff=0.0,
        ),
    )


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """A gpt_oss config.json for a resolved ``m``."""
    if not (
        m.attention_sinks
        and m.linear_bias
        and m.qkv_bias
        and m.glu_activation == "quick_gelu"
        and m.glu_up_offset == 1.0
        and m.glu_clamp is not None
        and m.moe.enabled
        and m.moe.normalize_topk
    ):
        raise ConfigError(
            "model.architecture=gpt_oss has an HF format with attention_sinks, linear_bias, qkv_bias, "
            "glu_activation=quick_gelu, glu_up_offset=1, a glu_clamp and a mixture-of-experts MLP only"
        )
    rope = yarn_to_hf(m.yarn, m.rope_theta) if m.yarn.enabled else {"rope_type": "default", "rope_theta": m.rope_theta}
    every = m.full_attention_every
    types = [
        "sliding_attention" if m.sliding_window is not None and (every is None or (i + 1) % every) else "full_attention"
        for i in range(m.num_layers)
    ]
    return {
        "architectures": [HF_CLASS],
        "model_type": MODEL_TYPE,
        "hidden_act": "silu",
        "attention_bias": True,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.moe.ffn_hidden_size or m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": m.tie_word_embeddings,
        "rope_parameters": rope,
        "sliding_window": m.sliding_window,
        "layer_types": types,
        "num_local_experts": m.moe.num_experts,
        "num_experts_per_tok": m.moe.router_topk,
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": m.glu_clamp,
        "router_aux_loss_coef": m.moe.aux_loss_coeff,
        "output_router_logits": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
