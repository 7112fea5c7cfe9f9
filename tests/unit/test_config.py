"""Configuration validation: each bad value is a ConfigError naming the field."""

import pytest

from megatron_kl.config import (
    ConfigError,
    ModelConfig,
    ModelParallelConfig,
    ParallelConfig,
    apply_overrides,
    from_dict,
    validate_parallel,
)


def _model(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=50)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize(
    "model,parallel,world,field",
    [
        (_model(), ParallelConfig(tensor_parallel=8), 8, "num_attention_heads"),
        (_model(num_attention_heads=8, num_query_groups=2), ParallelConfig(tensor_parallel=4), 4, "num_query_groups"),
        (_model(), ParallelConfig(pipeline_parallel=8), 8, "num_layers"),
        (_model(num_layers=3), ParallelConfig(pipeline_parallel=2), 2, "num_layers"),
        (_model(), ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 6, "world size"),
        (_model(architecture="gpt5"), ParallelConfig(), 1, "model.architecture"),
        (_model(num_query_groups=3), ParallelConfig(), 1, "num_query_groups"),
        (_model(ffn_hidden_size=129), ParallelConfig(tensor_parallel=2), 2, "ffn_hidden_size"),
        (_model(), ParallelConfig(sequence_parallel=True), 1, "sequence_parallel"),
        (_model(), ParallelConfig(pipeline_parallel=2, virtual_pipeline=2), 2, "virtual_pipeline"),
        (_model(logprob_path="cut_ce"), ParallelConfig(), 1, "model.logprob_path"),
        (_model(logprob_chunk_rows=0), ParallelConfig(), 1, "model.logprob_chunk_rows"),
    ],
)
def test_invalid_layouts_name_the_field(model, parallel, world, field):
    with pytest.raises(ConfigError, match=field):
        validate_parallel(model, parallel, world)


def test_valid_layout_passes():
    validate_parallel(_model(), ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 8)


def test_padded_vocab_follows_megatron_convention():
    model = _model(vocab_size=50, make_vocab_size_divisible_by=16)
    assert model.padded_vocab_size(1) == 64
    assert model.padded_vocab_size(2) == 64
    assert model.padded_vocab_size(4) == 64
    assert _model(vocab_size=65, make_vocab_size_divisible_by=16).padded_vocab_size(2) == 96


def test_architecture_defaults_resolve():
    q2, q3, llama = (_model(architecture=a).resolved() for a in ("qwen2", "qwen3", "llama"))
    assert (q2.qkv_bias, q2.qk_layernorm) == (True, False)
    assert (q3.qkv_bias, q3.qk_layernorm) == (False, True)
    assert (llama.qkv_bias, llama.qk_layernorm) == (False, False)
    assert q2.kv_channels == 16
    assert _model(architecture="qwen2", qkv_bias=False).resolved().qkv_bias is False


def test_yaml_dict_and_overrides():
    data = apply_overrides({"model": {"num_layers": 2}}, ["parallel.tensor_parallel=2", "model.architecture=llama"])
    cfg = from_dict(ModelParallelConfig, data)
    assert cfg.parallel.tensor_parallel == 2 and cfg.model.architecture == "llama" and cfg.model.num_layers == 2
    with pytest.raises(ConfigError, match="model.num_layer"):
        from_dict(ModelParallelConfig, {"model": {"num_layer": 2}})
    with pytest.raises(ConfigError, match="parallel.tensor_parallel"):
        from_dict(ModelParallelConfig, {"parallel": {"tensor_parallel": "two"}})
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["oops"])


def test_sequence_parallel_without_transformer_engine_is_a_clear_error():
    from megatron_kl.models import builder

    if builder.have_transformer_engine():
        pytest.skip("Transformer Engine is installed: sequence parallel is supported")
    with pytest.raises(ConfigError, match="sequence_parallel.*Transformer Engine"):
        builder.build_gpt_model(_model(), ParallelConfig(tensor_parallel=2, sequence_parallel=True))


def test_logprob_path_auto_fuses_when_the_logits_outgrow_the_fused_chunks():
    from megatron_kl.models.pipeline import FUSED_MIN_LOGITS_PER_CHUNK, VocabOptions
    from megatron_kl.vocab_parallel.fused_linear import linear_chunk_rows

    auto = VocabOptions.for_model(_model(vocab_size=151936), ParallelConfig())
    assert auto.fused is None and auto.grad_in_forward
    for local_vocab in (64, 32000, 152064, 152064 // 8):
        threshold = FUSED_MIN_LOGITS_PER_CHUNK * linear_chunk_rows(local_vocab, single_pass=True)
        assert not auto.use_fused(threshold - 1, local_vocab) and auto.use_fused(threshold, local_vocab)
    assert not auto.use_fused(1024, 32000)  # recomputing backward: unfused needs less memory there (README)
    assert auto.use_fused(4096, 152064)
    # a forward-only pass or the single-pass gradient: fused from one full chunk of rows (measured faster)
    for local_vocab in (64, 32000, 49152, 152064 // 8):
        chunk = linear_chunk_rows(local_vocab)
        assert not auto.use_fused(chunk - 1, local_vocab, single_sweep=True)
        assert auto.use_fused(chunk, local_vocab, single_sweep=True)
    assert auto.use_fused(1824, 49152, single_sweep=True) and not auto.use_fused(1824, 49152)
    forced = VocabOptions.for_model(_model(logprob_path="fused", logprob_chunk_rows=9), ParallelConfig())
    unfused = VocabOptions.for_model(_model(logprob_path="unfused"), ParallelConfig())
    assert forced.use_fused(1, 64) and not unfused.use_fused(10**7, 152064)
    assert forced.chunk_size == 9 and auto.vocab_size == 151936


def test_secret_looking_launch_env_values_are_redacted_for_files_and_trackers():
    from megatron_kl.config import REDACTED, redact_secrets

    data = {
        "launch": {
            "env": {"WANDB_API_KEY": "k1", "HF_TOKEN": "t", "NCCL_DEBUG": "INFO"},
            "slurm": {"env": {"DB_PASSWORD": "p", "AWS_SECRET_ACCESS_KEY": "s", "OMP_NUM_THREADS": "8"}},
        },
        "rollout": {"sglang": {"api_key_env": "MEGATRON_KL_SGLANG_API_KEY"}},
    }
    out = redact_secrets(data)
    assert out["launch"]["env"] == {"WANDB_API_KEY": REDACTED, "HF_TOKEN": REDACTED, "NCCL_DEBUG": "INFO"}
    assert out["launch"]["slurm"]["env"] == {
        "DB_PASSWORD": REDACTED,
        "AWS_SECRET_ACCESS_KEY": REDACTED,
        "OMP_NUM_THREADS": "8",
    }
    assert out["rollout"] == data["rollout"] and data["launch"]["env"]["HF_TOKEN"] == "t"  # a copy; names kept


@pytest.mark.parametrize(
    "moe,parallel,world,message",
    [
        (
            dict(num_experts=6),
            dict(expert_parallel=4),
            4,
            "model.moe.num_experts=6 is not divisible by parallel.expert_parallel=4",
        ),
        (
            dict(num_experts=8),
            dict(expert_parallel=4, tensor_parallel=2),
            4,
            "parallel.expert_tensor_parallel\\*expert_parallel=2x4 must divide",
        ),
        (
            dict(num_experts=8),
            dict(expert_parallel=2, pipeline_parallel=2),
            2,
            "expert_tensor_parallel\\*expert_parallel=1x2",
        ),
        (
            dict(num_experts=8, ffn_hidden_size=30),
            dict(expert_tensor_parallel=4, tensor_parallel=1),
            4,
            "expert_tensor_parallel=4 must divide the expert width",
        ),
        (dict(num_experts=0), dict(expert_parallel=2), 2, "need a mixture-of-experts model"),
        (dict(num_experts=4, router_topk=5), {}, 1, "router_topk=5"),
        (dict(num_experts=0, routing_replay="rollout"), {}, 1, "routing_replay=rollout needs a mixture-of-experts"),
        (dict(num_experts=4, routing_replay="replay"), {}, 1, "routing_replay='replay': use one of"),
        (dict(num_experts=4, token_dispatcher="flex"), {}, 1, "token_dispatcher='flex'"),
        (dict(num_experts=4, capacity_factor=0.0), {}, 1, "capacity_factor=0.0"),
    ],
)
def test_expert_layouts_and_moe_fields_name_the_field(moe, parallel, world, message):
    from megatron_kl.config import MoEConfig

    with pytest.raises(ConfigError, match=message):
        validate_parallel(ModelConfig(moe=MoEConfig(**moe)), ParallelConfig(**parallel), world)


def test_valid_expert_layouts_pass():
    from megatron_kl.config import MoEConfig

    model = ModelConfig(moe=MoEConfig(num_experts=8, router_topk=2))
    for parallel, world in (
        (dict(expert_parallel=8), 8),
        (dict(tensor_parallel=2, expert_parallel=4), 8),
        (dict(tensor_parallel=2, expert_parallel=2, pipeline_parallel=2), 8),
        (dict(tensor_parallel=2, expert_tensor_parallel=1, expert_parallel=4), 8),
    ):
        validate_parallel(model, ParallelConfig(**parallel), world)


def test_moe_training_with_tensor_parallelism_needs_sequence_parallelism():
    from megatron_kl.config import MoEConfig, validate_training_layout

    moe = ModelConfig(moe=MoEConfig(num_experts=4))
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=true"):
        validate_training_layout(moe, ParallelConfig(tensor_parallel=2, expert_parallel=2))
    validate_training_layout(moe, ParallelConfig(tensor_parallel=2, sequence_parallel=True))
    validate_training_layout(moe, ParallelConfig(expert_parallel=2))
    validate_training_layout(ModelConfig(), ParallelConfig(tensor_parallel=2))


def test_routing_replay_needs_an_engine_that_reports_routing_and_reads_yaml_off():
    """vLLM does not report the experts it routed to: routing replay with it is refused naming both fields; a bare
    YAML `off` (read as false) is the "off" setting."""
    import yaml

    from megatron_kl.config import from_dict
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig

    data = yaml.safe_load("model: {moe: {num_experts: 4, routing_replay: off}}")
    assert from_dict(TrainConfig, data).model.moe.routing_replay == "off"
    replay = {"model": {"moe": {"num_experts": 4, "routing_replay": "rollout"}}}
    for engine in ("local", "sglang"):
        cfg = from_dict(TrainConfig, {**replay, "rollout": {"engine": engine}})
        validate_train_config(cfg, cfg.model.vocab_size)
    cfg = from_dict(TrainConfig, {**replay, "rollout": {"engine": "vllm"}})
    with pytest.raises(ConfigError, match="model.moe.routing_replay=rollout with rollout.engine=vllm"):
        validate_train_config(cfg, cfg.model.vocab_size)
