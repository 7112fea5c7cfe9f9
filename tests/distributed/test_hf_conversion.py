"""HF <-> Megatron conversion for tiny random Llama-3.x / Qwen2 / Qwen3 models built with transformers'
config classes: Megatron logits at TP=1, TP=2 and PP=2 equal the HF model's in fp32; export from a sharded
layout is bit-exact; mismatches and missing tensors are clear errors."""

import json

import pytest
import torch

from megatron_kl.config import ConfigError, ParallelConfig
from megatron_kl.models import hf
from megatron_kl.testing.distributed import run_ranks
from tests.distributed.hf_workers import FAMILIES, convert_worker, hf_logits, make_hf_model

LAYOUTS = {
    "tp1": ParallelConfig(),
    "tp2": ParallelConfig(tensor_parallel=2),
    "pp2": ParallelConfig(pipeline_parallel=2),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_hf_model(family, root / family, seed=i) for i, family in enumerate(FAMILIES)}


def _tokens():
    return torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(0))


def _safetensors(directory):
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_logits_match_hf(hf_models, tmp_path, family, layout):
    tokens = _tokens()
    expected = hf_logits(hf_models[family], tokens)
    parallel = LAYOUTS[layout]
    world = parallel.tensor_parallel * parallel.pipeline_parallel
    export = tmp_path / "export" if layout != "tp1" else None
    outs = run_ranks(convert_worker, world, str(hf_models[family]), parallel, tokens, export)
    assert_logits_match(outs, expected, f"{family} {layout}")
    if export is not None:  # round trip from a sharded layout: the same tensors, bit for bit
        assert_bit_exact_export(hf_models[family], export)
        assert len(list(export.glob("*.safetensors"))) > 1 and (export / "model.safetensors.index.json").is_file()
        assert (export / "chat_template.jinja").read_text() == (hf_models[family] / "chat_template.jinja").read_text()


def assert_logits_match(outs: list, expected: torch.Tensor, what: str) -> None:
    """The last stage's gathered logits equal transformers' (relative error < 1e-5), on logits far from uniform."""
    logits = next(o["logits"] for o in outs if o["logits"] is not None)
    assert logits.shape == expected.shape
    assert expected.std() > 0.5, "precondition: logits far from uniform"
    err = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-5, f"{what}: relative error {err:.2e}"


def assert_bit_exact_export(original_dir, export) -> None:
    """The exported safetensors hold the original's tensors bit for bit (names, dtypes, values), and config.json."""
    original, exported = _safetensors(original_dir), _safetensors(export)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert json.loads((export / "config.json").read_text()) == json.loads((original_dir / "config.json").read_text())


def test_config_derivation(hf_models):
    llama = hf.HFCheckpoint(hf_models["llama"]).model_config()
    assert (llama.architecture, llama.rope_scaling_factor, llama.tie_word_embeddings, llama.qkv_bias) == (
        "llama",
        32.0,
        True,
        False,
    )
    qwen2 = hf.HFCheckpoint(hf_models["qwen2"]).model_config()
    assert (qwen2.qkv_bias, qwen2.qk_layernorm, qwen2.tie_word_embeddings, qwen2.rope_theta) == (
        True,
        False,
        False,
        1e6,
    )
    qwen3 = hf.HFCheckpoint(hf_models["qwen3"]).model_config()
    assert (qwen3.kv_channels, qwen3.qk_layernorm, qwen3.num_query_groups) == (24, True, 2)
    assert hf.HFCheckpoint(hf_models["qwen2"]).dtype == "bfloat16"
    # the derived config.json of an export reads back as the same model
    again = hf.model_config_from_hf(hf.hf_config_from_model(llama))
    hf.check_model_config(llama, again)


def test_mismatch_and_missing_tensor_are_clear_errors(hf_models, tmp_path):
    import dataclasses
    import shutil

    from safetensors.torch import load_file, save_file

    checkpoint = hf.HFCheckpoint(hf_models["qwen3"])
    given = dataclasses.replace(checkpoint.model_config(), num_layers=6, hidden_size=128)
    with pytest.raises(ConfigError, match=r"model\.num_layers=6 .* has 4.*model\.hidden_size=128"):
        hf.model_config_for_run(given, checkpoint)
    # fields left at their defaults are completed from config.json; set ones are checked
    from megatron_kl.config import ModelConfig

    derived = checkpoint.model_config()
    completed = hf.model_config_for_run(ModelConfig(params_dtype="float32", max_position_embeddings=64), checkpoint)
    for field in hf.STRUCTURAL_FIELDS:
        assert getattr(completed.resolved(), field) == getattr(derived.resolved(), field), field
    assert (completed.params_dtype, completed.max_position_embeddings) == ("float32", 64)
    assert {"architecture", "num_layers", "ffn_hidden_size", "kv_channels"} <= {
        f for f in hf.STRUCTURAL_FIELDS if getattr(derived, f) != getattr(ModelConfig(), f)
    }  # really completed
    with pytest.raises(ConfigError, match=r"model\.num_layers=6 .* has 4"):
        hf.model_config_for_run(ModelConfig(num_layers=6), checkpoint)
    with pytest.raises(ConfigError, match="model_type"):
        hf.model_config_from_hf({**checkpoint.config, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="low_freq_factor"):
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "rope_theta": 5e5}
        hf.model_config_from_hf({**hf.HFCheckpoint(hf_models["llama"]).config, "rope_parameters": rope})
    broken = tmp_path / "broken"
    shutil.copytree(hf_models["qwen3"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    view = hf.HFStateView(hf.HFCheckpoint(broken), checkpoint.model_config())
    with pytest.raises(KeyError, match=r"lacks tensor 'model\.layers\.2\.self_attn\.k_proj\.weight'.*linear_qkv"):
        view["decoder.layers.2.self_attention.linear_qkv.weight"]
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.HFCheckpoint(tmp_path)


def test_convert_cli_import_tp2_export_round_trip(hf_models, tmp_path):
    """`megatron-kl convert --hf ... --tp 2` then `--megatron ... --out` (export at TP=1): bit-exact, with
    the tokenizer files and config.json carried along; a mismatching --config exits 2 naming the field."""
    import subprocess
    import sys

    source = hf_models["qwen2"]
    megatron_dir, exported = tmp_path / "megatron", tmp_path / "hf_out"

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "megatron_kl.cli", "convert", *args], capture_output=True, text=True, timeout=600
        )

    done = cli("--hf", str(source), "--out", str(megatron_dir), "--tp", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (megatron_dir / "model").is_dir() and (megatron_dir / "hf_source" / "chat_template.jinja").is_file()
    done = cli("--megatron", str(megatron_dir), "--out", str(exported))
    assert done.returncode == 0, done.stderr[-3000:]
    original, back = _safetensors(source), _safetensors(exported)
    assert set(back) == set(original)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], v) for k, v in original.items())
    assert (exported / "tokenizer_config.json").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  architecture: qwen2\n  num_layers: 2\n  hidden_size: 64\n")
    done = cli("--hf", str(source), "--out", str(tmp_path / "x"), "--config", str(bad))
    assert done.returncode == 2 and "model.num_layers=2" in done.stderr


@pytest.mark.parametrize("world", [1, 2])
def test_qwen3_with_yarn_context_scaling_matches_hf(tmp_path, world):
    """Qwen3's long-context recipe (rope_scaling yarn: here factor 4 over 8 original positions, so the 12 tokens
    reach past them) converts to model.yarn: logits equal transformers' at TP 1 and 2, the export bit-exact."""
    from megatron_kl.config import ParallelConfig
    from megatron_kl.testing.distributed import run_ranks
    from tests.distributed.hf_workers import convert_worker, hf_logits

    FAMILIES["qwen3_yarn"] = {
        **FAMILIES["qwen3"],
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    }
    try:
        source = make_hf_model("qwen3_yarn", tmp_path / "qwen3_yarn", seed=7)
    finally:
        FAMILIES.pop("qwen3_yarn")
    model = hf.HFCheckpoint(source).model_config()
    assert model.yarn.factor == 4.0 and model.yarn.original_max_position_embeddings == 8
    tokens = _tokens()
    outs = run_ranks(
        convert_worker, world, str(source), ParallelConfig(tensor_parallel=world), tokens, tmp_path / "export"
    )
    assert_logits_match(outs, hf_logits(source, tokens), f"qwen3 yarn TP={world}")
    assert_bit_exact_export(source, tmp_path / "export")
    hf.check_model_config(hf.model_config_from_hf(hf.hf_config_from_model(model)), model)
