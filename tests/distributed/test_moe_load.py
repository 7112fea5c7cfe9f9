"""Expert-load metrics of a mixture-of-experts policy, from router hooks: every token routed to top-k experts
(counts sum to tokens x k per layer), a router whose logits all tie sends every token to the same k experts
(imbalance = experts / k), and a capacity factor drops what exceeds each expert's share."""

import pytest
import torch

from megatron_kl.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_kl.testing.distributed import run_ranks
from tests.distributed.moe_workers import expert_load_worker

MODEL = ModelConfig(
    architecture="qwen3",
    num_layers=2,
    vocab_size=50,
    make_vocab_size_divisible_by=16,
    moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32),
)


def _tokens():
    return torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(0))


def test_counts_cover_every_token_and_a_tied_router_is_reported_imbalanced():
    tokens = _tokens()
    routed = run_ranks(expert_load_worker, 1, MODEL, ParallelConfig(), tokens, False)[0]
    assert torch.equal(routed["counts"].sum(-1), routed["tokens"] * 2)  # top-2 of every token the router saw
    assert routed["tokens"][0] >= tokens.numel()
    metrics = routed["metrics"]
    assert metrics["moe/tokens_per_expert_mean"] == pytest.approx(float(routed["counts"].mean()))
    assert 1.0 <= metrics["moe/load_imbalance"] < 2.0 and "moe/dropped_fraction" not in metrics
    tied = run_ranks(expert_load_worker, 1, MODEL, ParallelConfig(), tokens, True)[0]
    assert tied["metrics"]["moe/load_imbalance"] == pytest.approx(2.0)  # all tokens on 2 of 4 experts
    assert tied["metrics"]["moe/tokens_per_expert_min"] == 0.0


def test_capacity_factor_drops_are_counted():
    capped = ModelConfig(
        **{**MODEL.__dict__, "moe": MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, capacity_factor=1.0)}
    )
    tied = run_ranks(expert_load_worker, 1, capped, ParallelConfig(), _tokens(), True)[0]
    # two experts take everything, each at most its even share (tokens x 2 / 4): half the routes are dropped
    assert tied["metrics"]["moe/dropped_fraction"] == pytest.approx(0.5)
    assert tied["metrics"]["moe/tokens_per_expert_max"] <= tied["tokens"][0] * 2 / 4
