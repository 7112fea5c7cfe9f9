"""The trainer's check that sampled tokens lie in its truncated support (train/step.py support_metrics)."""

import pytest
import torch

from megatron_kl.config import ConfigError
from megatron_kl.models.pipeline import TokenStats
from megatron_kl.rollout.engine import Completion, SamplingConfig
from megatron_kl.train.rollouts import RolloutBatch
from megatron_kl.train.step import OutsideSupport, support_metrics


def _batch(versions):
    completions = [Completion([1, 2, 3], [4, 5, 6, 7], [-1.0] * 4, "length", v) for v in versions]
    mask = torch.zeros(len(versions), 6)
    mask[:, 2:6] = 1.0  # responses start after the 3 prompt tokens (position 2 predicts token 3)
    return RolloutBatch(
        0,
        completions,
        torch.zeros(len(versions)),
        torch.zeros(len(versions), 7, dtype=torch.long),
        mask,
        torch.zeros(len(versions), 6),
        torch.tensor(versions),
        0.0,
    )


def _old(outside):
    shape = outside.shape
    return TokenStats(
        logprobs=torch.zeros(shape),
        entropy=torch.zeros(shape),
        kept_mass=torch.full(shape, 0.9),
        support_size=torch.full(shape, 5.0),
        outside_support=outside,
    )


def test_a_fresh_token_outside_the_support_is_named():
    batch = _batch([3, 3])
    outside = torch.zeros(2, 6)
    outside[1, 4] = 1.0  # completion 1, response position 2
    with pytest.raises(OutsideSupport, match="completion 1, response position 2"):
        support_metrics(batch, _old(outside), 3, SamplingConfig(top_k=5, support_tolerance=0.0), None)
    metrics = support_metrics(batch, _old(outside), 3, SamplingConfig(top_k=5, support_tolerance=0.2), None)
    assert metrics["sampling/outside_support"] == pytest.approx(1 / 8)
    assert metrics["sampling/truncated_mass"] == pytest.approx(0.1)


def test_stale_rows_may_leave_the_support_and_masked_positions_do_not_count():
    outside = torch.zeros(2, 6)
    outside[0, 3] = 1.0
    outside[:, 0] = 1.0  # prompt positions: masked
    metrics = support_metrics(_batch([2, 3]), _old(outside), 3, SamplingConfig(top_k=5, support_tolerance=0.0), None)
    assert metrics["sampling/outside_support"] == pytest.approx(1 / 8)
    untruncated = TokenStats(logprobs=torch.zeros(1, 6), entropy=torch.zeros(1, 6))
    assert support_metrics(_batch([3]), untruncated, 3, SamplingConfig(), None) == {}


def test_sampling_fields_are_validated():
    for bad in (dict(distribution="nucleus"), dict(support_tolerance=-0.1), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ConfigError, match="rollout.sampling." + next(iter(bad))):
            SamplingConfig(**bad)


def test_a_vllm_server_without_processed_logprobs_is_refused_under_truncation():
    from megatron_kl.config import from_dict
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig

    base = {
        "rollout": {
            "engine": "vllm",
            "vllm": {"mode": "server", "url": "http://127.0.0.1:8000"},
            "sampling": {"top_p": 0.9},
        }
    }
    cfg = from_dict(TrainConfig, base)
    with pytest.raises(ConfigError, match="rollout.vllm.server_logprobs_mode=processed_logprobs"):
        validate_train_config(cfg, cfg.model.vocab_size)
    base["rollout"]["vllm"]["server_logprobs_mode"] = "processed_logprobs"
    cfg = from_dict(TrainConfig, base)
    validate_train_config(cfg, cfg.model.vocab_size)
    base["rollout"]["vllm"]["server_logprobs_mode"] = "logits"
    with pytest.raises(ConfigError, match="rollout.vllm.server_logprobs_mode"):
        from_dict(TrainConfig, base)


def test_strict_refuses_the_full_distribution_under_truncation():
    from megatron_kl.config import from_dict
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig

    cfg = from_dict(
        TrainConfig, {"kl": {"strict": True}, "rollout": {"sampling": {"top_k": 5, "distribution": "full"}}}
    )
    with pytest.raises(ConfigError, match="rollout.sampling.distribution=truncated"):
        validate_train_config(cfg, cfg.model.vocab_size)


def test_the_forward_kl_target_is_refused_under_truncation():
    from megatron_kl.config import from_dict
    from megatron_kl.train.checks import validate_train_config
    from megatron_kl.train.config import TrainConfig

    cfg = from_dict(
        TrainConfig, {"kl": {"target": "token_forward", "estimator": "k3"}, "rollout": {"sampling": {"top_p": 0.9}}}
    )
    with pytest.raises(ConfigError, match="kl.target=token_forward .*infinite"):
        validate_train_config(cfg, cfg.model.vocab_size)
