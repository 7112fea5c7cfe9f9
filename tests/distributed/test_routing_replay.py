"""Routing replay: the embedded engine records the experts every fed token was routed to, at the positions the
trainer's forward sees them; the policy's forward given that routing reproduces the engine's log-probs where the
routers' logits tie (and its own routing does not); the reference routes itself."""

import dataclasses

import torch

from megatron_kl.config import ModelConfig, MoEConfig
from megatron_kl.testing.distributed import run_ranks
from tests.distributed.moe_workers import engine_routing_worker, replay_worker

MODEL = ModelConfig(
    architecture="qwen3",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=40,
    max_position_embeddings=64,
    init_method_std=0.2,
    moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32),
)
# distinct lengths (the ragged scheme prefills each length; the forcing scheme feeds the longer prompts' tokens)
# and repeated prompts (prefilled once, their cache and routing copied to every row)
PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 9, 9, 9, 2], [3], [1, 8], [1, 8]]
SAMPLING = {"temperature": 1.0, "max_new_tokens": 7, "stop_token_ids": [2]}


def test_engine_records_the_routing_of_every_fed_token_in_either_decoding_scheme():
    out = run_ranks(engine_routing_worker, 1, MODEL, PROMPTS, SAMPLING)[0]
    agree, slots = 0, 0
    for ragged, forcing, full in zip(out["ragged"], out["forcing"], out["full_forward"]):
        assert ragged.response_ids == forcing.response_ids
        positions = len(ragged.prompt_ids) + len(ragged.response_ids) - 1
        for completion in (ragged, forcing):
            routing = completion.routed_experts
            assert tuple(routing.shape) == (positions, MODEL.num_layers, MODEL.moe.router_topk)
            assert bool((routing >= 0).all()) and bool((routing < MODEL.moe.num_experts).all())
        assert torch.equal(ragged.routed_experts.sort(-1).values, forcing.routed_experts.sort(-1).values)
        # a full forward over the same tokens routes each position as the engine did (sets of experts; the
        # random router's logits are far from ties)
        same = ragged.routed_experts.sort(-1).values == full.sort(-1).values
        agree, slots = agree + int(same.all(-1).sum()), slots + same.shape[0] * same.shape[1]
    assert slots > 60 and agree == slots


def test_replayed_policy_reproduces_the_engine_and_the_reference_routes_itself():
    replaying = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, routing_replay="rollout"))
    out = run_ranks(replay_worker, 1, replaying, PROMPTS, SAMPLING, 1e-7)[0]
    mask = out["mask"].bool()
    gap = {name: (out[name] - out["behavior"])[mask].abs() for name in ("replayed", "own")}
    assert gap["replayed"].max() < 1e-4, gap["replayed"].max()  # the dense bound of the step-0 gates
    assert gap["own"].mean() > 100 * gap["replayed"].mean() and gap["own"].max() > 1e-2, gap["own"].max()
    # the reference ignores the routing it is given: the same log-probs as without it, and (same weights) as the
    # policy's own routing
    assert torch.equal(out["reference_given_routing"], out["reference"])
    torch.testing.assert_close(out["reference"], out["own"], rtol=0, atol=0)
