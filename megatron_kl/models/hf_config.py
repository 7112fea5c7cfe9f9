"""HF ``config.json`` <-> :class:`ModelConfig` for every supported family (Llama-3.x, Qwen2/2.5, Qwen3, their MoE
variants, DeepSeek-V3, GPT-OSS): what each key becomes, and what megatron-core cannot build exactly refused naming
the key and the reason."""

from __future__ import annotations

from megatron_kl.config import MODEL_FAMILIES, ConfigError, ModelConfig, ModelFamily, MoEConfig, YarnConfig
from megatron_kl.models.hf_rope import yarn_from_hf, yarn_to_hf


def family_of_model_type(model_type) -> ModelFamily:
    """The registered family whose ``hf_classes`` list config.json's ``model_type`` (qwen2_moe: qwen2)."""
    for _, family in MODEL_FAMILIES.items():
        if model_type in family.hf_classes:
            return family
    known = sorted(t for _, f in MODEL_FAMILIES.items() for t in f.hf_classes)
    raise ConfigError(f"config.json model_type={model_type!r} is not supported; use one of {known}")


def hf_class(family: ModelFamily, model_type: str) -> str:
    """config.json's ``architectures[0]`` for ``model_type`` of ``family``."""
    if model_type not in family.hf_classes:
        raise ConfigError(
            f"model.architecture={family.name} has no HF model_type {model_type!r} (its ModelFamily."
            f"hf_classes: {sorted(family.hf_classes)}); it cannot be exported in HF format"
        )
    return family.hf_classes[model_type]


def family_mapping(model: ModelConfig):
    """The family's HF mapping module (``ModelFamily.hf_mapping``), or None where its names are Llama's."""
    return MODEL_FAMILIES.get(model.architecture, "model.architecture").mapping()


MOE_STRUCTURAL_FIELDS = (
    "num_experts",
    "router_topk",
    "ffn_hidden_size",
    "shared_expert_ffn_hidden_size",
    "normalize_topk",
    "shared_expert_gate",
    "score_function",
    "expert_bias",
    "num_groups",
    "group_topk",
    "routed_scaling_factor",
    "first_dense_layers",
)
# megatron-core's llama3 RoPE scaling fixes these (RotaryEmbedding._apply_scaling); only the factor is free
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# fields of ModelConfig that describe the weights (checked against config.json); the rest are run choices
STRUCTURAL_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "rope_theta",
    "rope_scaling_factor",
    "norm_epsilon",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_layernorm",
    "mla",
    "yarn",
    "attention_sinks",
    "sliding_window",
    "full_attention_every",
    "linear_bias",
    "glu_activation",
    "glu_up_offset",
    "glu_clamp",
)


# ---------------------------------------------------------------------------------------------- configs


def _rope(hf: dict) -> dict:
    """RoPE settings from either config.json style: transformers>=5 ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    if hf.get("rope_parameters"):
        return dict(hf["rope_parameters"])
    return {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """The ModelConfig of an HF ``config.json`` (dict). Unsupported features are ConfigErrors naming the key."""
    model_type = hf.get("model_type")
    family = family_of_model_type(model_type)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    for key in ("mlp_bias", "use_sliding_window"):
        if hf.get(key):
            raise ConfigError(f"config.json {key}=true is not supported by the Megatron mapping")
    rope = _rope(hf)
    mapping = family.mapping()
    if mapping is not None:
        return ModelConfig(**{**mapping.model_config_values(hf, rope), **overrides})
    if model_type == "llama" and hf.get("attention_bias"):
        raise ConfigError("config.json attention_bias=true (an o_proj bias) is not supported; Llama-3.x has none")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling, yarn = None, YarnConfig()
    if rope_type == "yarn":  # Qwen2.5 / Qwen3 long context
        yarn = yarn_from_hf(rope, hf.get("max_position_embeddings", 4096), model_type)
    elif rope_type == "llama3":
        for key, fixed in LLAMA3_ROPE_FIXED.items():
            if key in rope and float(rope[key]) != fixed:
                raise ConfigError(
                    f"config.json rope {key}={rope[key]}: megatron-core's llama3 RoPE scaling fixes it to {fixed}"
                )
        scaling = float(rope["factor"])
    elif rope_type not in ("default", None):
        raise ConfigError(f"config.json rope_type={rope_type!r} is not supported (default, llama3 or yarn)")
    heads = hf["num_attention_heads"]
    moe = _moe_from_hf(hf) if model_type.endswith("_moe") else MoEConfig()
    values = dict(
        architecture=family.name,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling_factor=scaling,
        yarn=yarn,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(family.defaults.get("qkv_bias")) or bool(hf.get("attention_bias", False)),
        qk_layernorm=bool(family.defaults.get("qk_layernorm")),
        moe=moe,
    )
    values.update(overrides)
    return ModelConfig(**values)


def _moe_from_hf(hf: dict) -> MoEConfig:
    """model.moe of a qwen2_moe / qwen3_moe config.json: every layer sparse (decoder_sparse_step 1, no
    mlp_only_layers), the router's top-k renormalised as norm_topk_prob says, Qwen2-MoE's shared expert."""
    step = hf.get("decoder_sparse_step", 1)
    if step != 1 or hf.get("mlp_only_layers"):
        raise ConfigError(
            f"config.json decoder_sparse_step={step} / mlp_only_layers={hf.get('mlp_only_layers')}: "
            "dense layers among the sparse ones are not supported; every layer must be sparse"
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise ConfigError("config.json of a mixture-of-experts model has no num_experts (or num_local_experts)")
    return MoEConfig(
        num_experts=int(experts),
        router_topk=int(hf["num_experts_per_tok"]),
        ffn_hidden_size=int(hf["moe_intermediate_size"]),
        shared_expert_ffn_hidden_size=int(hf.get("shared_expert_intermediate_size") or 0),
        normalize_topk=bool(hf.get("norm_topk_prob", False)),
    )


def check_model_config(derived: ModelConfig, given: ModelConfig, source: str = "the HF checkpoint") -> None:
    """Raise a ConfigError naming every structural field where ``given`` (the run's model config) differs
    from ``derived`` (read from the checkpoint)."""
    a, b = derived.resolved(), given.resolved()
    diffs = [
        f"model.{k}={getattr(b, k)!r} but {source} has {getattr(a, k)!r}"
        for k in STRUCTURAL_FIELDS
        if getattr(a, k) != getattr(b, k)
    ]
    if a.moe.enabled or b.moe.enabled:
        diffs += [
            f"model.moe.{k}={getattr(b.moe, k)!r} but {source} has {getattr(a.moe, k)!r}"
            for k in MOE_STRUCTURAL_FIELDS
            if _expert_width(a, k) != _expert_width(b, k)
        ]
    if diffs:
        raise ConfigError(
            "model config does not match the checkpoint: "
            + "; ".join(diffs)
            + " (make the model section of the YAML match config.json)"
        )


def _expert_width(model: ModelConfig, key: str):
    """model.moe.<key>, the expert width resolved (null means model.ffn_hidden_size)."""
    if key == "ffn_hidden_size" and model.moe.enabled:
        return model.moe.ffn_hidden_size or model.ffn_hidden_size
    return getattr(model.moe, key)


def hf_config_from_model(model: ModelConfig, dtype: str = "bfloat16") -> dict:
    """A config.json for ``model`` (used when exporting without an original config.json)."""
    m = model.resolved()
    family = m.architecture
    spec = MODEL_FAMILIES.get(family, "model.architecture")
    if spec.mapping() is not None:
        return spec.mapping().hf_config(m, dtype)
    dense_type = next(iter(spec.hf_classes), None)
    if dense_type is None:
        raise ConfigError(
            f"model.architecture={family} declares no HF model_type (ModelFamily.hf_classes): it has no "
            "config.json to export"
        )
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "factor": m.rope_scaling_factor, "rope_theta": m.rope_theta, **LLAMA3_ROPE_FIXED}
    elif m.yarn.enabled:
        rope = yarn_to_hf(m.yarn, m.rope_theta)
    config = {
        "architectures": [hf_class(spec, dense_type)],
        "model_type": dense_type,
        "hidden_act": "silu",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": m.tie_word_embeddings,
        "rope_theta": m.rope_theta,
        "rope_scaling": None
        if rope["rope_type"] == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if family == "llama":
        config.update(attention_bias=bool(m.qkv_bias), mlp_bias=False)
    if m.moe.enabled:
        if family == "llama":
            raise ConfigError("model.moe with model.architecture=llama has no HF format; use qwen2 or qwen3")
        model_type = f"{dense_type}_moe"
        config.update(
            architectures=[hf_class(spec, model_type)],
            model_type=model_type,
            num_experts=m.moe.num_experts,
            num_experts_per_tok=m.moe.router_topk,
            moe_intermediate_size=m.moe.ffn_hidden_size or m.ffn_hidden_size,
            norm_topk_prob=m.moe.normalize_topk,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=m.moe.aux_loss_coeff,
            output_router_logits=False,
        )
        if family == "qwen2":
            config.update(shared_expert_intermediate_size=m.moe.shared_expert_ffn_hidden_size)
        elif m.moe.shared_expert_ffn_hidden_size:
            raise ConfigError(
                "model.moe.shared_expert_ffn_hidden_size with qwen3 has no HF format (Qwen3-MoE has no "
                "shared expert); set it to 0 or use model.architecture=qwen2"
            )
    return config
