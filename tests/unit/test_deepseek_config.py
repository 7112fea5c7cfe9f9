"""DeepSeek-V3's config.json <-> ModelConfig: every field derived, the round trip exact, and what megatron-core
cannot build exactly refused naming the key and the reason."""

import dataclasses

import pytest

from megatron_kl.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig, validate_parallel
from megatron_kl.model_variants import MLAConfig, YarnConfig
from megatron_kl.models import hf

V3 = dict(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_interleave=True,
    hidden_act="silu",
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_theta=10000,
)


def test_deepseek_v3_config_is_derived_field_by_field():
    m = hf.model_config_from_hf(V3)
    assert m.architecture == "deepseek_v3" and m.multi_latent_attention
    assert m.mla == MLAConfig(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
    )
    assert m.yarn == YarnConfig(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert m.moe == MoEConfig(
        num_experts=256,
        router_topk=8,
        ffn_hidden_size=2048,
        shared_expert_ffn_hidden_size=2048,
        shared_expert_gate=False,
        normalize_topk=True,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=8,
        group_topk=4,
        routed_scaling_factor=2.5,
        first_dense_layers=3,
    )
    assert m.resolved().kv_channels == 128 and m.num_query_groups == 128 and m.rope_theta == 10000.0
    validate_parallel(m, ParallelConfig(tensor_parallel=8, pipeline_parallel=1, expert_parallel=64), 512)


def test_round_trip_through_config_json_is_exact():
    for values in (
        V3,
        {
            **V3,
            "q_lora_rank": None,
            "rope_interleave": False,
            "n_group": 1,
            "topk_group": 1,
            "rope_scaling": None,
            "n_shared_experts": 2,
        },
    ):
        m = hf.model_config_from_hf(values)
        again = hf.model_config_from_hf(hf.hf_config_from_model(m))
        assert again == m.resolved() or dataclasses.replace(again, kv_channels=None) == m
        hf.check_model_config(again, m)


@pytest.mark.parametrize(
    "change,key",
    [
        ({"num_experts_per_tok": 6}, "topk_group"),  # 6 / 4 groups: transformers' top-2 group score differs
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {**V3["rope_scaling"], "truncate": False}}, "truncate"),
        ({"rope_scaling": {**V3["rope_scaling"], "attention_factor": 1.3}}, "attention_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_what_megatron_cannot_build_exactly_is_refused(change, key):
    with pytest.raises(ConfigError, match=key):
        hf.model_config_from_hf({**V3, **change})


def test_structural_mismatch_names_the_field():
    derived = hf.model_config_from_hf(V3)
    given = dataclasses.replace(derived, mla=dataclasses.replace(derived.mla, kv_lora_rank=256))
    with pytest.raises(ConfigError, match="model.mla="):
        hf.check_model_config(derived, given)
    given = dataclasses.replace(derived, moe=dataclasses.replace(derived.moe, group_topk=2))
    with pytest.raises(ConfigError, match="model.moe.group_topk=2 but"):
        hf.check_model_config(derived, given)


@pytest.mark.parametrize(
    "model,field",
    [
        (ModelConfig(architecture="deepseek_v3", num_attention_heads=4, num_query_groups=2), "model.num_query_groups"),
        (
            ModelConfig(architecture="deepseek_v3", num_attention_heads=4, num_query_groups=4, rope_scaling_factor=8.0),
            "model.rope_scaling_factor",
        ),
        (
            ModelConfig(
                architecture="deepseek_v3",
                num_attention_heads=4,
                num_query_groups=4,
                yarn=YarnConfig(factor=4.0, truncate=False),
            ),
            "model.yarn.truncate",
        ),
        (ModelConfig(full_attention_every=2), "model.full_attention_every"),
        (ModelConfig(moe=MoEConfig(num_experts=4, score_function="sigmoid", normalize_topk=False)), "normalize_topk"),
        (ModelConfig(moe=MoEConfig(num_experts=4, expert_bias=True)), "model.moe.expert_bias"),
        (ModelConfig(moe=MoEConfig(num_experts=8, num_groups=3, group_topk=1)), "model.moe.num_groups"),
        (ModelConfig(moe=MoEConfig(num_experts=8, num_groups=4)), "model.moe.group_topk"),
        (ModelConfig(moe=MoEConfig(num_experts=8, router_topk=3, num_groups=4, group_topk=2)), "model.moe.group_topk"),
        (ModelConfig(num_layers=2, moe=MoEConfig(num_experts=8, first_dense_layers=2)), "model.moe.first_dense_layers"),
    ],
)
def test_model_section_refusals_name_the_field(model, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        model.resolved()


def test_tensor_parallel_must_split_the_latent_projections():
    model = ModelConfig(
        architecture="deepseek_v3",
        num_attention_heads=4,
        num_query_groups=4,
        mla=MLAConfig(q_lora_rank=25, kv_lora_rank=16),
    )
    with pytest.raises(ConfigError, match="model.mla.q_lora_rank=25"):
        validate_parallel(model, ParallelConfig(tensor_parallel=2), 2)
