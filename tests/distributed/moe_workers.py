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
    return {"metrics": load.metrics((), model_cfg.moe.capacity_factor is not None), "counts": load.counts.clone(),
            "tokens": load.tokens.clone()}
