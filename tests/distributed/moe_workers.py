"""Rank functions of the mixture-of-experts tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import torch

from megatron_kl.config import ModelConfig, ParallelConfig


def expert_load_worker(rank, world, model_cfg: ModelConfig, parallel_cfg: ParallelConfig, tokens, zero_router: bool):
    """Record one forward of a tiny MoE policy (router weights zeroed: every logit ties); the load metrics and
    the raw counts."""
    from megatron_kl.models import builder, moe_load, parallel, pipeline

    parallel.initialize(model_cfg, parallel_cfg, seed=3)
    chunks = builder.build_model_chunks(model_cfg, parallel_cfg)
    if zero_router:
        with torch.no_grad():
            for name, param in chunks[0].named_parameters():
                if name.endswith("mlp.router.weight"):
                    param.zero_()
    load = moe_load.expert_load(chunks, model_cfg)
    batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=torch.ones(tokens.shape[0], tokens.shape[1] - 1))
    vocab = pipeline.VocabOptions(vocab_size=model_cfg.vocab_size)
    with torch.no_grad(), load.recording():
        pipeline.compute_token_stats(chunks, batch, 2, vocab)
    return {
        "metrics": load.metrics((), model_cfg.moe.capacity_factor is not None),
        "counts": load.counts.clone(),
        "tokens": load.tokens.clone(),
    }


def _tie_routers(chunks: list, relative: float, seed: int = 0) -> None:
    """Every router row a copy of the first, perturbed by ``relative`` (the experts' logits tie to within about
    float32 rounding: which expert wins is decided by the kernels' rounding)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in chunks[0].named_parameters():
            if name.endswith("mlp.router.weight"):
                noise = torch.randn(param.shape, generator=generator).to(param.device)
                param.copy_(param[:1].expand_as(param) * (1 + relative * noise))


def engine_routing_worker(rank, world, model_cfg: ModelConfig, prompts, sampling_dict: dict):
    """The embedded engine's routing under both decoding schemes, and each completion's routing in one full forward
    of the engine's model over prompt + response (what the trainer's forward sees)."""
    from megatron_kl.models import builder, parallel
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.local import LocalEngine

    layout = ParallelConfig()
    parallel.initialize(model_cfg, layout, seed=3)
    policy = builder.build_model_chunks(model_cfg, layout)
    engine = LocalEngine(model_cfg, layout)
    engine.update_weights(policy, version=1)
    sampling = SamplingConfig(**sampling_dict)
    out = {}
    for ragged in (True, False):
        engine.ragged_decoding = ragged
        out["ragged" if ragged else "forcing"] = engine.generate(prompts, sampling, seed=5)
    full = []
    with torch.no_grad():
        for completion in out["ragged"]:
            tokens = torch.tensor([completion.prompt_ids + completion.response_ids])
            engine.model(tokens, torch.arange(tokens.shape[1])[None], None)
            full.append(engine.routing.take(1, tokens.shape[1])[0, :-1])
    return {**out, "full_forward": full}


def replay_worker(rank, world, model_cfg: ModelConfig, prompts, sampling_dict: dict, tie: float):
    """A policy built with routing replay and its reference, routers tied to ``tie``: the engine's behaviour
    log-probs and the trainer's log-probs of the same sequences - the policy given the engine's routing
    (replayed), the policy without it (its own routing), and the reference given it (which routes itself)."""
    from megatron_kl.models import builder, parallel, pipeline
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.local import LocalEngine
    from megatron_kl.train.batching import pack, pack_routing

    layout = ParallelConfig()
    parallel.initialize(model_cfg, layout, seed=3)
    models = builder.build_policy_and_reference(model_cfg, layout)
    for chunks in (models.policy, models.reference):
        _tie_routers(chunks, tie)
    engine = LocalEngine(model_cfg, layout)
    engine.update_weights(models.policy, version=1)
    sampling = SamplingConfig(**sampling_dict)
    completions = engine.generate(prompts, sampling, seed=5)
    tokens, mask, behavior = pack(
        prompts, [c.response_ids for c in completions], 0, per_token=[c.response_logprobs for c in completions]
    )
    routing = pack_routing([c.routed_experts for c in completions], tokens.shape[1])
    vocab = pipeline.VocabOptions(model_cfg.vocab_size, sampling.logprob_temperature)

    def logprobs(chunks, routed: bool):
        batch = pipeline.SequenceBatch(tokens, mask, routed_experts=routing if routed else None)
        return pipeline.compute_token_stats(chunks, batch, 2, vocab).logprobs

    return {
        "mask": mask,
        "behavior": behavior,
        "replayed": logprobs(models.policy, True),
        "own": logprobs(models.policy, False),
        "reference_given_routing": logprobs(models.reference, True),
        "reference": logprobs(models.reference, False),
    }
