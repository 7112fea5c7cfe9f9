"""The paper's three model configs: each YAML loads, fits an 8 x H100 node's layout, and its model section
matches the model's real config.json (stored under tests/data/hf_configs, transformers 4.x style)."""

import json
from pathlib import Path

import pytest

from megatron_kl.config import validate_parallel
from megatron_kl.models import hf
from megatron_kl.train.config import load_train_config

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["qwen2.5-7b", "llama-3.1-8b-instruct", "qwen3-4b-instruct-2507"]


@pytest.mark.parametrize("name", NAMES)
def test_paper_config_matches_hf_config_and_fits_8_gpus(name):
    cfg = load_train_config(str(ROOT / "configs" / "paper" / f"{name}.yaml"))
    real = json.loads((ROOT / "tests" / "data" / "hf_configs" / f"{name}.json").read_text())
    hf.check_model_config(hf.model_config_from_hf(real), cfg.model, f"{name} config.json")
    validate_parallel(cfg.model, cfg.parallel, 8)
    assert cfg.init.hf_checkpoint and cfg.task.math.tokenizer == cfg.init.hf_checkpoint
    assert cfg.checkpoint.export_hf and not cfg.warm_start.enabled
    # the exported config.json of this model config reads back as the same model
    hf.check_model_config(hf.model_config_from_hf(hf.hf_config_from_model(cfg.model)), cfg.model)
    # LLM vocabularies take the fused log-prob path
    from megatron_kl.models.pipeline import VocabOptions

    assert VocabOptions.for_model(cfg.model, cfg.parallel).fused
