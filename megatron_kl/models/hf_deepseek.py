"""Hugging Face ``DeepseekV3ForCausalLM`` <-> Megatron GPTModel with multi-latent attention (the parts that differ
from the Llama / Qwen mapping of :mod:`megatron_kl.models.hf`).

Attention (layer i, prefix ``model.layers.i.self_attn.`` / ``decoder.layers.i.self_attention.``):

    q_proj.weight (q_lora_rank null)      linear_q_proj.weight
    q_a_proj.weight                       linear_q_down_proj.weight
    q_a_layernorm.weight                  q_layernorm.weight (TE spec: linear_q_up_proj.layer_norm_weight)
    q_b_proj.weight                       linear_q_up_proj.weight
    kv_a_proj_with_mqa.weight             linear_kv_down_proj.weight
    kv_a_layernorm.weight                 kv_layernorm.weight (TE spec: linear_kv_up_proj.layer_norm_weight)
    kv_b_proj.weight                      linear_kv_up_proj.weight
    o_proj.weight                         linear_proj.weight

Megatron's MLA reads each head's rotary dimensions as interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
layout, HF ``rope_interleave: true``). A checkpoint with ``rope_interleave: false`` pairs x_j with x_{j+d/2}; its
rotary rows (the last qk_rope_head_dim of every query head and of the shared key) are permuted on the way in,
row 2j <- j and 2j+1 <- j + d/2, and back on the way out, so both compute the same scores.

Mixture of experts (layers >= first_k_dense_replace): ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias``
-> ``mlp.router.weight`` / ``mlp.router.expert_bias`` (kept a frozen parameter: models/builder.py), experts as in
Qwen-MoE, ``mlp.shared_experts.{gate,up,down}_proj`` -> ``mlp.shared_experts.linear_fc{1,2}`` (no gate).
The first layers' dense MLPs are named as Llama's. Multi-token-prediction layers (``num_nextn_predict_layers``)
are not part of transformers' model and are neither read nor written.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_kl.config import ConfigError, ModelConfig, MoEConfig
from megatron_kl.model_variants import MLAConfig, YarnConfig
from megatron_kl.models.hf_rope import yarn_from_hf, yarn_to_hf

MODEL_TYPE = "deepseek_v3"
HF_CLASS = "DeepseekV3ForCausalLM"

_ATTENTION = {  # megatron suffix within a layer -> HF suffix within model.layers.i.
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_ROTARY_ROWS = (
    "self_attention.linear_q_proj.weight",
    "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
)


def layer_hf_names(suffix: str) -> Optional[list[str]]:
    """The HF suffixes (within ``model.layers.i.``) of a DeepSeek-specific Megatron suffix; None for the rest."""
    if suffix in _ATTENTION:
        return [_ATTENTION[suffix]]
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        return ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"]
    return None


def _rotary_permutation(model: ModelConfig, suffix: str, rows: int) -> Optional[torch.Tensor]:
    """Row order taking HF's non-interleaved rotary rows to megatron's interleaved pairs (None: none needed)."""
    if model.mla.rope_interleave or suffix not in _ROTARY_ROWS:
        return None
    d = model.mla.qk_rope_head_dim
    pairs = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).reshape(-1)  # 0, d/2, 1, ...
    order = torch.arange(rows)
    if suffix == "self_attention.linear_kv_down_proj.weight":  # [latent; one shared rotary key]
        order[rows - d :] = rows - d + pairs
        return order
    head = model.mla.query_head_dim  # every head: [nope; rotary]
    order = order.view(-1, head)
    order[:, head - d :] = order[:, head - d :][:, pairs]
    return order.reshape(-1)


def to_megatron(suffix: str, tensor: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    order = _rotary_permutation(model, suffix, tensor.shape[0])
    return tensor if order is None else tensor[order].contiguous()


def to_hf(suffix: str, tensor: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    order = _rotary_permutation(model, suffix, tensor.shape[0])
    return tensor if order is None else tensor[torch.argsort(order)].contiguous()


# ---------------------------------------------------------------------------------------------- configs


def _yarn(rope: dict, max_positions: int) -> YarnConfig:
    yarn = yarn_from_hf(rope, max_positions, "DeepSeek-V3")
    if not yarn.truncate:
        raise ConfigError(
            "config.json rope truncate=false: megatron-core's multi-latent attention rounds the YaRN "
            "correction range (truncate=true) only"
        )
    return yarn


def _moe(hf: dict) -> MoEConfig:
    if int(hf.get("first_k_dense_replace") or 0) >= hf["num_hidden_layers"]:
        return MoEConfig()  # every layer dense
    experts, topk = hf.get("n_routed_experts"), int(hf["num_experts_per_tok"])
    if not experts:
        raise ConfigError("config.json n_routed_experts is missing: a DeepSeek-V3 model routes over experts")
    if topk > 1 and not hf.get("norm_topk_prob", True):
        raise ConfigError(
            "config.json norm_topk_prob=false: megatron-core's sigmoid router always renormalises the "
            "kept scores; only norm_topk_prob=true converts exactly"
        )
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if group_topk >= groups:  # every group kept: no group limit
        groups = group_topk = None
    elif topk % group_topk or topk // group_topk != 2:
        # transformers scores a group by the sum of its top 2 scores, megatron by its top (top-k / group top-k)
        raise ConfigError(
            f"config.json num_experts_per_tok={topk} / topk_group={group_topk}: transformers scores a "
            "group by its top 2 experts, megatron-core by its top num_experts_per_tok / topk_group; they "
            "agree only when that ratio is 2 (DeepSeek-V3: 8 / 4)"
        )
    shared = int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"])
    return MoEConfig(
        num_experts=int(experts),
        router_topk=topk,
        ffn_hidden_size=int(hf["moe_intermediate_size"]),
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=False,
        normalize_topk=True,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups,
        group_topk=group_topk,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        first_dense_layers=int(hf.get("first_k_dense_replace") or 0),
    )


def model_config_values(hf: dict, rope: dict) -> dict:
    """ModelConfig fields of a deepseek_v3 config.json (``rope``: its RoPE parameters, either style)."""
    if hf.get("attention_bias"):
        raise ConfigError("config.json attention_bias=true: DeepSeek-V3's projections have no biases here")
    heads = hf["num_attention_heads"]
    return dict(
        architecture=MODEL_TYPE,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=False,
        qk_layernorm=True,
        mla=MLAConfig(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)),
        ),
        yarn=_yarn(rope, hf.get("max_position_embeddings", 4096)),
        moe=_moe(hf),
    )


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """A deepseek_v3 config.json for a resolved ``m``."""
    mla, moe, yarn = m.mla, m.moe, m.yarn
    rope = yarn_to_hf(yarn, m.rope_theta) if yarn.enabled else {"rope_type": "default", "rope_theta": m.rope_theta}
    if moe.enabled and (
        moe.score_function != "sigmoid"
        or not moe.expert_bias
        or moe.shared_expert_gate
        and moe.shared_expert_ffn_hidden_size
    ):
        raise ConfigError(
            "model.architecture=deepseek_v3 has an HF format with model.moe.score_function=sigmoid, "
            "expert_bias=true and shared_expert_gate=false only"
        )
    expert_width = moe.ffn_hidden_size or m.ffn_hidden_size
    if moe.shared_expert_ffn_hidden_size % expert_width:
        raise ConfigError(
            f"model.moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size} must be a "
            f"multiple of the expert width {expert_width} (HF n_shared_experts)"
        )
    return {
        "architectures": [HF_CLASS],
        "model_type": MODEL_TYPE,
        "hidden_act": "silu",
        "attention_bias": False,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": m.tie_word_embeddings,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_rope_head_dim,
        "rope_interleave": mla.rope_interleave,
        "rope_parameters": rope,
        "n_routed_experts": moe.num_experts or 1,
        "num_experts_per_tok": moe.router_topk,
        "moe_intermediate_size": expert_width,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // expert_width,
        "n_group": moe.num_groups or 1,
        "topk_group": moe.group_topk or 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": moe.routed_scaling_factor or 1.0,
        "first_k_dense_replace": moe.first_dense_layers if moe.enabled else m.num_layers,
        "num_nextn_predict_layers": 0,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
