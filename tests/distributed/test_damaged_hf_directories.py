"""A damaged HF model directory is named, never a library traceback: ``megatron-kl convert --hf`` and
``init.hf_checkpoint`` on a truncated or corrupt safetensors file, a malformed config.json or index, and a
config.json whose hidden size disagrees with the weights (the field and the tensor named)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.models import hf
from tests.distributed.hf_workers import make_hf_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("hf") / "model", seed=0)


def _truncate(d: Path):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _corrupt_header(d: Path):
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:40] = b"\x00" * 32  # inside the JSON header
    (d / "model.safetensors").write_bytes(bytes(data))


def _bad_config(d: Path):
    (d / "config.json").write_text((d / "config.json").read_text()[:-20])


def _config_as_list(d: Path):
    (d / "config.json").write_text("[1, 2]")


def _hidden_size(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["hidden_size"] *= 2
    (d / "config.json").write_text(json.dumps(config))


def _bad_index(d: Path):
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')


CASES = {
    "truncated": (_truncate, r"model.safetensors is not a readable safetensors file .*truncated or damaged"),
    "corrupt header": (_corrupt_header, r"model.safetensors is not a readable safetensors file"),
    "malformed config.json": (_bad_config, r"config.json is not valid JSON"),
    "config.json not an object": (_config_as_list, r"config.json must hold a JSON object, not a list"),
    "hidden size": (
        _hidden_size,
        r"config.json says vocab_size=\d+, hidden_size=\d+ but .*model.safetensors holds "
        r"model.embed_tokens.weight of shape \[\d+, \d+\] \(expected \[\d+, \d+\]\)",
    ),
    "index without a weight map": (_bad_index, r"model.safetensors.index.json has no weight_map"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_directory_is_named_by_the_checkpoint_reader_and_by_convert(tmp_path, model_dir, case):
    damage, message = CASES[case]
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    damage(broken)
    with pytest.raises(ConfigError, match=message):
        hf.HFCheckpoint(broken).check_shapes()
    done = subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "convert", "--hf", str(broken), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and str(broken) in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_the_intact_directory_passes_the_same_checks(model_dir):
    hf.HFCheckpoint(model_dir).check_shapes()
