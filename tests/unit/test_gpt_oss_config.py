"""GPT-OSS's config.json <-> ModelConfig: every field derived (gpt-oss-20b's config), the round trip exact, the fused
experts' rows mapped both ways, and what megatron-core cannot build exactly refused naming the key and the reason."""

import dataclasses

import pytest
import torch

from megatron_kl.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig, validate_parallel
from megatron_kl.model_variants import YarnConfig
from megatron_kl.models import hf, hf_gpt_oss

GPT_OSS_20B = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    attention_bias=True,
    head_dim=64,
    hidden_act="silu",
    hidden_size=2880,
    intermediate_size=2880,
    max_position_embeddings=131072,
    num_attention_heads=64,
    num_experts_per_tok=4,
    num_hidden_layers=24,
    num_key_value_heads=8,
    num_local_experts=32,
    rms_norm_eps=1e-05,
    sliding_window=128,
    swiglu_limit=7.0,
    tie_word_embeddings=False,
    vocab_size=201088,
    router_aux_loss_coef=0.9,
    layer_types=["sliding_attention", "full_attention"] * 12,
    rope_theta=150000,
    rope_scaling={
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
)


def test_gpt_oss_20b_config_is_derived_field_by_field():
    m = hf.model_config_from_hf(GPT_OSS_20B)
    assert (m.architecture, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels) == (
        "gpt_oss",
        24,
        2880,
        64,
        8,
        64,
    )
    assert (m.attention_sinks, m.sliding_window, m.full_attention_every, m.linear_bias, m.qkv_bias) == (
        True,
        128,
        2,
        True,
        True,
    )
    assert (m.glu_activation, m.glu_up_offset, m.glu_clamp) == ("quick_gelu", 1.0, 7.0)
    assert m.yarn == YarnConfig(
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        truncate=False,
    )
    assert m.moe == MoEConfig(num_experts=32, router_topk=4, ffn_hidden_size=2880, normalize_topk=True)
    assert m.rope_theta == 150000.0 and m.norm_epsilon == 1e-5
    validate_parallel(m, ParallelConfig(tensor_parallel=2, expert_parallel=8, expert_tensor_parallel=1), 16)


def test_round_trip_through_config_json_is_exact():
    for values in (
        GPT_OSS_20B,
        {
            **GPT_OSS_20B,
            "rope_scaling": None,
            "sliding_window": 64,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention"],
        },
        {**GPT_OSS_20B, "num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2},
    ):
        values = {**values, "layer_types": (values["layer_types"] * 2)[: values["num_hidden_layers"]]}
        m = hf.model_config_from_hf(values)
        again = hf.model_config_from_hf(hf.hf_config_from_model(m))
        hf.check_model_config(again, m)
        assert again.full_attention_every == m.full_attention_every and again.sliding_window == m.sliding_window


def test_expert_rows_map_to_megatron_and_back_exactly():
    generator = torch.Generator().manual_seed(0)
    hidden, inner = 6, 4
    rows = {
        "linear_fc1.weight": torch.randn(hidden, 2 * inner, generator=generator),
        "linear_fc1.bias": torch.randn(2 * inner, generator=generator),
        "linear_fc2.weight": torch.randn(inner, hidden, generator=generator),
        "linear_fc2.bias": torch.randn(hidden, generator=generator),
    }
    fc1 = hf_gpt_oss.expert_to_megatron("linear_fc1.weight", rows["linear_fc1.weight"])
    assert torch.equal(fc1[:inner], rows["linear_fc1.weight"][:, 0::2].t())  # gate: the even columns
    assert torch.equal(fc1[inner:], rows["linear_fc1.weight"][:, 1::2].t())  # up: the odd ones
    for kind, row in rows.items():
        assert torch.equal(hf_gpt_oss.expert_to_hf(kind, hf_gpt_oss.expert_to_megatron(kind, row)), row), kind


def test_the_fuser_writes_each_layer_once_all_experts_are_in():
    fuser = hf_gpt_oss.ExpertFuser(num_experts=2)
    out = []
    for expert in (1, 0):
        out += list(
            fuser.add(
                f"decoder.layers.3.mlp.experts.local_experts.{expert}.linear_fc2.bias", torch.full((3,), float(expert))
            )
        )
    assert [name for name, _ in out] == ["model.layers.3.mlp.experts.down_proj_bias"]
    assert torch.equal(out[0][1], torch.tensor([[0.0] * 3, [1.0] * 3]))
    fuser.check_done()
    list(fuser.add("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.bias", torch.zeros(3)))
    with pytest.raises(ValueError, match="incomplete expert layers"):
        fuser.check_done()


@pytest.mark.parametrize(
    "change,key",
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
        ({"attention_bias": False}, "attention_bias"),
        ({"swiglu_alpha": 1.5}, "swiglu_alpha"),
        ({"layer_types": ["full_attention", "sliding_attention"] * 12}, "layer_types"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ],
)
def test_what_megatron_cannot_build_exactly_is_refused(change, key):
    with pytest.raises(ConfigError, match=key):
        hf.model_config_from_hf({**GPT_OSS_20B, **change})


def test_layout_refusals_name_the_field():
    m = hf.model_config_from_hf(GPT_OSS_20B)
    with pytest.raises(ConfigError, match="parallel.expert_tensor_parallel=1"):
        validate_parallel(m, ParallelConfig(tensor_parallel=2), 2)
    with pytest.raises(ConfigError, match="model.moe.router_topk=1 with normalize_topk"):
        dataclasses.replace(m, moe=dataclasses.replace(m.moe, router_topk=1)).resolved()
    with pytest.raises(ConfigError, match="model.architecture=gpt_oss has an HF format"):
        hf.hf_config_from_model(dataclasses.replace(m, attention_sinks=False))
    assert ModelConfig(architecture="gpt_oss").resolved().qkv_bias
