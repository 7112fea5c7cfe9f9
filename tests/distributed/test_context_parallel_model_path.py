"""The model side of context parallelism, what runs without Transformer Engine: the microbatch split is
megatron-core's (``get_batch_on_this_cp_rank`` on the padded inputs), every target stays with its input position
across chunk boundaries, the pipeline's statistics + loss on the shards equal one rank's (log-probs, entropy and
exact KL from logits through ``_unfused_stats``, then the microbatch loss with a sequence-level KL), gathered
per-token statistics equal the whole sequences', clamp counts sum over the group; and every layout that cannot
run is refused naming the field."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_kl.algo.losses import AlgoConfig, MicrobatchLoss, Shares
from megatron_kl.config import ConfigError, ModelConfig, ParallelConfig, validate_parallel
from megatron_kl.kl.objective import KLConfig
from megatron_kl.kl.sequence_axis import LOCAL
from megatron_kl.models import context_parallel
from megatron_kl.models.batch import Microbatch
from megatron_kl.models.pipeline import VocabOptions, _unfused_stats, masked_token_stats
from megatron_kl.testing import distributed

VOCAB, BATCH, LENGTH = 10, 3, 11


def _microbatch(seed: int = 0) -> Microbatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    loss_mask = torch.zeros(BATCH, LENGTH - 1)
    for b, start in enumerate((2, 5, 8)):
        loss_mask[b, start:] = 1.0
    per_target = {
        key: 0.1 * torch.randn(BATCH, LENGTH - 1, generator=g, dtype=torch.float64)
        for key in ("old_logprobs", "behavior_logprobs", "reference_logprobs")
    }
    advantages = torch.randn(BATCH, 1, generator=g, dtype=torch.float64).expand(BATCH, LENGTH - 1).contiguous()
    return Microbatch(
        tokens=tokens, loss_mask=loss_mask, rows=torch.arange(BATCH), index=0, advantages=advantages, **per_target
    )


def _logits(tokens: torch.Tensor) -> torch.Tensor:
    """A stand-in for the model: logits [b, s, V] from each input token and its position's parity (local)."""
    table = torch.linspace(-2, 2, VOCAB * VOCAB, dtype=torch.float64).reshape(VOCAB, VOCAB).sin() * 3
    return table[tokens].clone().requires_grad_(True)


def _loss(mb: Microbatch, axis, tp_group=None):
    logits = _logits(mb.tokens)
    stats = _unfused_stats(VocabOptions(vocab_size=VOCAB, temperature=0.8), None, mb, logits, tp_group)
    mb = dataclasses.replace(
        mb,
        **{
            key: stats.logprobs.detach() + getattr(mb, key)
            for key in ("old_logprobs", "behavior_logprobs", "reference_logprobs")
        },
    )
    kl = KLConfig(estimator="k3", placement="loss", level="sequence", coef=0.2, off_policy="none")
    algo = AlgoConfig(behavior_correction="sequence_tis")
    shares = Shares(num_sequences=BATCH, num_tokens=float(_microbatch().loss_mask.sum()))
    loss, metrics = MicrobatchLoss(algo, kl, shares, axis=axis)(stats, mb)
    (grad,) = torch.autograd.grad(loss * axis.share, logits)
    part = masked_token_stats(stats, mb, ("logprobs", "entropy"))
    assert torch.equal(part.rows, mb.rows)
    gathered = {"logprobs": part.stats.logprobs, "entropy": part.stats.entropy}
    return float(loss), {k: float(v) for k, v in metrics.items()}, grad, gathered


def _worker(rank, world):
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = dist.group.WORLD
    mb = _microbatch()
    local = context_parallel.shard_microbatch(mb, world, rank, 2 * world)
    padded = -(-LENGTH // (2 * world)) * (2 * world)
    megatrons = get_batch_on_this_cp_rank(
        {"tokens": torch.nn.functional.pad(mb.tokens, (0, padded - LENGTH)).clone()}, group
    )["tokens"]
    # the pipeline's gather reads megatron's context-parallel group; here the world is that group
    import megatron_kl.models.pipeline as pipeline

    pipeline.context_parallel_group = lambda: group
    tp_group = [dist.new_group([r]) for r in range(world)][rank]  # TP = 1
    loss, metrics, grad, gathered = _loss(local, context_parallel.ContextParallelAxis(group), tp_group)
    counts = context_parallel.sum_counts(
        {"kl/clamped_k3": rank + 1, **({"only_rank_0": 2} if rank == 0 else {})}, group
    )
    return {
        "local": {f.name: getattr(local, f.name) for f in dataclasses.fields(local)},
        "megatrons_tokens": megatrons,
        "loss": loss,
        "metrics": metrics,
        "grad": grad,
        "gathered": gathered,
        "counts": counts,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_shards_are_megatrons_and_the_loss_equals_one_rank(world):
    results = distributed.run_ranks(_worker, world)
    mb = _microbatch()
    labels = torch.cat([mb.tokens[:, 1:], torch.zeros(BATCH, 1, dtype=mb.tokens.dtype)], 1)
    for r in results:
        local = r["local"]
        assert torch.equal(local["tokens"], r["megatrons_tokens"])  # megatron-core's zigzag split
        positions = local["position_ids"][0]
        for column, position in enumerate(positions.tolist()):  # every input keeps its own next token and mask
            if position < LENGTH:
                assert torch.equal(local["labels"][:, column], labels[:, position])
                expected_mask = mb.loss_mask[:, position] if position < LENGTH - 1 else torch.zeros(BATCH)
                assert torch.equal(local["loss_mask"][:, column], expected_mask)
            else:
                assert not local["loss_mask"][:, column].any()
        assert local["cp_targets"] == LENGTH - 1 and torch.equal(local["rows"], mb.rows)
    loss, metrics, grad, gathered = _loss(_microbatch(), LOCAL)
    for r in results:
        assert r["loss"] == pytest.approx(loss, rel=1e-12, abs=1e-14)
        assert r["metrics"].keys() == metrics.keys()
        for key, value in metrics.items():
            assert r["metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-14), key
        for key in ("logprobs", "entropy"):
            assert torch.allclose(r["gathered"][key], gathered[key], rtol=1e-13, atol=1e-15), key
        assert r["counts"] == {"kl/clamped_k3": float(sum(range(1, world + 1))), "only_rank_0": 2.0}
    # the logits gradient: each position lives on one rank
    full = torch.zeros_like(grad)
    for r in results:
        positions = r["local"]["position_ids"][0]
        keep = positions < LENGTH
        full[:, positions[keep]] += r["grad"][:, keep]
    assert torch.allclose(full, grad, rtol=1e-12, atol=1e-14)
    assert grad.abs().max() > 0


def _parallel(**kw):
    return ParallelConfig(**kw)


def test_layouts_that_cannot_run_are_refused_naming_the_field():
    model = ModelConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=32,
        max_position_embeddings=32,
    )
    validate_parallel(model, _parallel(context_parallel=2, tensor_parallel=2), 8)
    with pytest.raises(ConfigError, match=r"tensor_parallel\*pipeline_parallel\*context_parallel=8"):
        validate_parallel(model, _parallel(context_parallel=4, tensor_parallel=2), 4)  # world not divisible
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        validate_parallel(model, _parallel(context_parallel=2, pipeline_parallel=2), 4)
    with pytest.raises(ConfigError, match="max_position_embeddings=32 must be a multiple of 6"):
        validate_parallel(model, _parallel(context_parallel=3), 3)
    with pytest.raises(ConfigError, match="parallel.context_parallel=2 needs Transformer Engine"):
        context_parallel.check_runnable(_parallel(context_parallel=2), have_transformer_engine=False)
    context_parallel.check_runnable(_parallel(context_parallel=2), have_transformer_engine=True)
    context_parallel.check_runnable(_parallel(), have_transformer_engine=False)
    with pytest.raises(ValueError, match="neither per sequence"):
        context_parallel.shard_microbatch(
            Microbatch(
                tokens=torch.zeros(1, 6, dtype=torch.long), loss_mask=torch.zeros(1, 5), advantages=torch.zeros(1, 3)
            ),
            2,
            0,
            4,
        )


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["rollout.engine=sglang", "warm_start.enabled=false"], "parallel.context_parallel=2 needs Transformer Engine"),
        (["warm_start.enabled=false"], "rollout.engine=local generates with the training layout"),
        (["rollout.engine=sglang"], "warm_start (the supervised phase) does not split its sequences"),
    ],
)
def test_train_check_refuses_what_cannot_run_here(tmp_path, overrides, named):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from megatron_kl.models.builder import have_transformer_engine

    if have_transformer_engine() and "Transformer Engine" in named:
        pytest.skip("Transformer Engine is installed: context parallelism can run here")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "train",
            "--config",
            "configs/cpu/default.yaml",
            "--check",
            f"train.output_dir={tmp_path / 'run'}",
            "parallel.context_parallel=2",
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
        env={**os.environ, "WORLD_SIZE": "2"},
    )  # as torchrun starts it: two CP ranks
    assert done.returncode == 2 and named in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()
