"""Mixture-of-experts HF <-> Megatron: tiny random Qwen3-MoE, Qwen2-MoE, DeepSeek-V3 and GPT-OSS models written by
transformers load into megatron-core MoE GPTModels whose fp32 logits equal transformers' at EP=1 and across
expert-parallel layouts (EP=2, TP=2 x EP=2, PP=2 x EP=2 on gloo ranks), and export back bit for bit from the
sharded layouts."""

import json

import pytest
import torch

from megatron_kl.config import ConfigError, ParallelConfig
from megatron_kl.models import hf
from megatron_kl.testing.distributed import run_ranks
from tests.distributed.hf_workers import MOE_FAMILIES, convert_worker, hf_logits, make_hf_model
from tests.distributed.test_hf_conversion import _tokens, assert_bit_exact_export, assert_logits_match

LAYOUTS = {  # name -> (layout, world size)
    "ep1": (ParallelConfig(), 1),
    "ep2": (ParallelConfig(expert_parallel=2), 2),
    "tp2xep2": (ParallelConfig(tensor_parallel=2, expert_parallel=2), 4),
    "pp2xep2": (ParallelConfig(pipeline_parallel=2, expert_parallel=2), 4),
}
LAYOUTS.update(
    {
        "tp2": (ParallelConfig(tensor_parallel=2), 2),
        "pp2": (ParallelConfig(pipeline_parallel=2), 2),
        # megatron-core adds expert biases (GPT-OSS) with one expert-tensor-parallel rank only
        "tp2xetp1": (ParallelConfig(tensor_parallel=2, expert_tensor_parallel=1), 2),
    }
)
CASES = (
    [("qwen3_moe", layout) for layout in ("ep1", "ep2", "tp2xep2", "pp2xep2")]
    + [("qwen2_moe", "ep1"), ("qwen2_moe", "tp2xep2")]
    + [("deepseek_v3", layout) for layout in ("ep1", "tp2", "pp2xep2")]
    + [("deepseek_v3_plain", "ep1"), ("deepseek_v3_plain", "tp2xep2")]
    + [("gpt_oss", layout) for layout in ("ep1", "tp2xetp1", "pp2xep2")]
    + [("gpt_oss_every3", "ep1")]
)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    return {family: make_hf_model(family, root / family, seed=10 + i) for i, family in enumerate(MOE_FAMILIES)}


@pytest.mark.parametrize("family,layout", CASES)
def test_moe_logits_match_hf_and_export_is_bit_exact(moe_models, tmp_path, family, layout):
    tokens = _tokens()
    expected = hf_logits(moe_models[family], tokens)
    parallel, world = LAYOUTS[layout]
    export = tmp_path / "export"
    outs = run_ranks(convert_worker, world, str(moe_models[family]), parallel, tokens, export)
    assert_logits_match(outs, expected, f"{family} {layout}")
    assert_bit_exact_export(moe_models[family], export)


def test_moe_config_derivation_and_refusals(moe_models, tmp_path):
    derived = hf.HFCheckpoint(str(moe_models["qwen3_moe"])).model_config()
    assert derived.architecture == "qwen3" and derived.moe.num_experts == 8 and derived.moe.router_topk == 2
    assert (
        derived.moe.ffn_hidden_size == 32
        and derived.moe.normalize_topk
        and not derived.moe.shared_expert_ffn_hidden_size
    )
    qwen2 = hf.HFCheckpoint(str(moe_models["qwen2_moe"])).model_config()
    assert qwen2.moe.shared_expert_ffn_hidden_size == 48 and not qwen2.moe.normalize_topk and qwen2.resolved().qkv_bias
    config = json.loads((moe_models["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        hf.model_config_from_hf({**config, "mlp_only_layers": [0]})
    given = derived.__class__(moe=derived.moe.__class__(num_experts=4))
    with pytest.raises(ConfigError, match="model.moe.num_experts=4 but"):
        hf.check_model_config(derived, given)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_round_trip_through_a_megatron_checkpoint(moe_models, tmp_path, family):
    """What `megatron-kl convert --hf` then `--megatron` run (their ranks, here in process; the command line itself:
    tests/distributed/test_hf_conversion.py): the score-correction bias (a frozen parameter), the attention sinks and
    the fused experts go into a Megatron distributed checkpoint and come back bit for bit."""
    from megatron_kl.models import convert
    from tests.distributed.test_hf_conversion import _safetensors

    megatron_dir, exported = tmp_path / "megatron", tmp_path / "hf_out"
    run_ranks(convert.import_worker, 1, str(moe_models[family]), str(megatron_dir), ParallelConfig())
    run_ranks(convert.export_worker, 1, str(megatron_dir), str(exported))
    original, back = _safetensors(moe_models[family]), _safetensors(exported)
    assert set(back) == set(original)
    assert all(torch.equal(back[k], v) for k, v in original.items())
