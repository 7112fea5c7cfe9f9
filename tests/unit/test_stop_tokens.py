"""Stop tokens of a run started from an HF checkpoint: the tokenizer's eos plus generation_config.json's
eos_token_id (int or list; chat models stop at end-of-turn ids), config.json's as the fallback."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from megatron_kl.models.hf import HFCheckpoint
from megatron_kl.train.loop import default_stop_token_ids


def _checkpoint(tmp_path, config_eos, generation_eos="absent"):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": config_eos}))
    if generation_eos != "absent":
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    return HFCheckpoint(tmp_path)


TASK = SimpleNamespace(tokenizer=SimpleNamespace(eos_id=2))


@pytest.mark.parametrize(
    "config_eos, generation_eos, expected",
    [
        (2, [128001, 128008, 2], [2, 128001, 128008]),  # Llama-3.1-Instruct style list
        (2, 151645, [2, 151645]),  # an int
        (151643, "absent", [2, 151643]),  # no generation_config.json: config.json's
        (None, "absent", [2]),
    ],
)
def test_stop_tokens_include_the_checkpoints_eos_ids(tmp_path, config_eos, generation_eos, expected):
    assert default_stop_token_ids(TASK, _checkpoint(tmp_path, config_eos, generation_eos)) == expected
    assert default_stop_token_ids(TASK, None) == [2]


def test_a_malformed_eos_id_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id='</s>'"):
        _checkpoint(tmp_path, 2, "</s>").eos_token_ids()
