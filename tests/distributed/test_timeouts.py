"""parallel.distributed_timeout_s bounds megatron's groups (a hung rank ends a TP collective after it, not
after megatron's default 30 min), and served engines' retry budgets must end before it."""

import pytest

from megatron_kl.config import ConfigError, ModelConfig, apply_overrides, from_dict
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.checks import validate_train_config
from megatron_kl.train.config import TrainConfig
from megatron_kl.validation.model_workers import hung_rank_worker


def test_a_hung_rank_ends_the_tp_collective_after_the_configured_timeout():
    model = ModelConfig(architecture="qwen2", num_layers=2, vocab_size=50, make_vocab_size_divisible_by=16)
    outs = run_ranks(hung_rank_worker, 2, model, 4.0, timeout_s=120)
    assert outs[0]["error"] is not None and 3.0 <= outs[0]["seconds"] < 30.0, outs[0]


def _config(*overrides):
    from pathlib import Path

    import yaml

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "cpu" / "default.yaml").read_text())
    apply_overrides(data, list(overrides))
    cfg = from_dict(TrainConfig, data)
    validate_train_config(cfg, tokenizer_vocab=cfg.model.vocab_size)
    return cfg


def test_retry_budget_beyond_the_distributed_timeout_is_a_config_error():
    _config("rollout.engine=sglang", "rollout.sglang.urls=['http://h:1']")  # defaults fit
    with pytest.raises(ConfigError, match="not less than parallel.distributed_timeout_s=1800"):
        _config("rollout.engine=sglang", "rollout.sglang.urls=['http://h:1']", "rollout.sglang.request_timeout_s=600")
    with pytest.raises(ConfigError, match="rollout.vllm.*parallel.distributed_timeout_s=100"):
        _config(
            "rollout.engine=vllm",
            "rollout.vllm.mode=server",
            "rollout.vllm.url=http://h:2",
            "parallel.distributed_timeout_s=100",
        )
