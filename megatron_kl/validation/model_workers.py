"""Rank functions for the layout-equivalence tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import collections
import dataclasses
import os
import time

import torch
import torch.distributed as dist

from megatron_kl.config import ModelConfig, ParallelConfig
from megatron_kl.models import builder, context_parallel, optim, output_head, parallel, pipeline, state


class _SFTLikeLoss:
    """Share of -sum(logprob) + 0.1 sum(entropy) over response tokens, divided by the batch size; row-separable,
    so the fused path may form its gradients in the forward (``probe``)."""

    row_separable = True

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.probes = 0

    def __call__(self, stats, mb):
        # on a context-parallel shard the sums cross the group (the same loss on every CP rank: kl.sequence_axis)
        axis = context_parallel.sequence_axis(pipeline.context_parallel_group())
        mask = mb.loss_mask.to(stats.logprobs.dtype)
        loss = axis.total(-(stats.logprobs * mask) + 0.1 * (stats.entropy * mask)) / self.batch_size
        return loss, {"loss": loss.detach()}

    def probe(self, stats, mb):
        self.probes += 1
        return self(stats, mb)[0]


def _gather_logits(model_cfg: ModelConfig):
    """A forward-only loss_fn returning the full-vocabulary logits (gathered over TP, padding trimmed)."""
    from megatron.core import parallel_state

    def loss_fn(stats, mb):
        local = mb.logits.detach().contiguous()
        group = parallel_state.get_tensor_model_parallel_group()
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local, group=group)
        full = torch.cat(pieces, dim=-1)[..., : model_cfg.vocab_size]
        if mb.cp_targets is not None:  # a context-parallel shard of the input positions
            full = context_parallel.gather_positions(full, pipeline.context_parallel_group(), mb.cp_targets + 1)
        return torch.zeros(()), {"index": mb.index, "logits": full}

    return loss_fn


def layout_worker(
    rank,
    world,
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    full_state,
    tokens,
    loss_mask,
    num_microbatches: int,
    optim_cfg: optim.OptimConfig,
    fused: bool = False,
    grad_in_forward: bool = False,
    token_budget: int = 0,
):
    """Build policy+reference in the given layout from ``full_state`` (or fresh init when None), and
    return logits, token stats, gradients and the updated weights, all in the full layout. ``fused``:
    stats and gradients through the fused linear path (logits are gathered on the unfused path);
    ``grad_in_forward``: the fused single pass (gradients formed in the forward); ``token_budget``: the
    stats and the training step on microbatches packed by a token budget (the logits by equal slices)."""
    from megatron.core import parallel_state

    torch.manual_seed(0)
    parallel.initialize(model_cfg, parallel_cfg, seed=1234)
    tp_group, pp_group = parallel.tp_group(), parallel.pp_group()
    tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    tied = model_cfg.tie_word_embeddings
    models = builder.build_policy_and_reference(model_cfg, parallel_cfg)
    if full_state is None:
        full_state = state.full_state_dict(models.policy, model_cfg.vocab_size, tied, tp_group, pp_group)
    for chunks in (models.policy, models.reference):
        state.load_full_state_dict(chunks, full_state, tied, tp_rank, tp_size)

    batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=loss_mask)
    unfused = pipeline.VocabOptions(vocab_size=model_cfg.vocab_size, temperature=0.8, chunk_size=7)
    vocab = dataclasses.replace(unfused, fused=fused, chunk_size=5 if fused else 7, grad_in_forward=grad_in_forward)
    logits_out = pipeline.run_schedule(
        models.policy, batch, num_microbatches, _gather_logits(model_cfg), unfused, forward_only=True
    )
    logits = None
    if logits_out:
        logits = torch.cat([o["logits"] for o in sorted(logits_out, key=lambda o: o["index"])])
    policy_stats = pipeline.compute_token_stats(
        models.policy, batch, num_microbatches, vocab, token_budget=token_budget
    )
    reference_before = pipeline.compute_token_stats(models.reference, batch, num_microbatches, vocab)

    train = optim.build_train_state(models.policy, optim_cfg)
    loss_fn = _SFTLikeLoss(tokens.shape[0])
    step = optim.train_step(train, batch, num_microbatches, loss_fn, vocab, token_budget=token_budget)
    inner = [c.module for c in train.chunks]
    grads = state.full_state_dict(inner, model_cfg.vocab_size, tied, tp_group, pp_group, getter=optim.main_grad)
    updated = state.full_state_dict(inner, model_cfg.vocab_size, tied, tp_group, pp_group)
    reference_after = pipeline.compute_token_stats(models.reference, batch, num_microbatches, vocab)
    reference_requires_grad = any(p.requires_grad for c in models.reference for p in c.parameters())
    return {
        "core_attention": sorted(
            {type(m).__name__ for c in inner for n, m in c.named_modules() if n.endswith("core_attention")}
        ),
        "rms_norms": sorted({type(m).__name__ for c in inner for m in c.modules() if isinstance(m, torch.nn.RMSNorm)}),
        "param_dtypes": sorted({str(p.dtype) for c in inner for p in c.parameters()}),
        "recompute": inner[0].config.recompute_granularity,
        "main_param_dtypes": sorted({str(p.dtype) for g in train.optimizer.param_groups for p in g["params"]}),
        "full_state": full_state,
        "logits": logits,
        "logprobs": policy_stats.logprobs,
        "entropy": policy_stats.entropy,
        "reference_before": reference_before.logprobs,
        "reference_after": reference_after.logprobs,
        "reference_requires_grad": reference_requires_grad,
        "probes": loss_fn.probes,
        "grads": grads,
        "updated": updated,
        "grad_norm": step.grad_norm,
        "is_last_stage": parallel_state.is_pipeline_last_stage(),
    }


def exact_kl_metric_worker(
    rank, world, model_cfg: ModelConfig, parallel_cfg: ParallelConfig, tokens, loss_mask, settings: list
):
    """The trainer's exact-KL metric (``compute_token_stats`` of the policy with the reference head, as
    ``rl_step``'s old pass) with a reference whose output weight is the policy's + eps * noise / sqrt(H).
    Returns, per (eps, fused) setting, the metric and what a float64 recomputation needs."""
    torch.manual_seed(0)
    parallel.initialize(model_cfg, parallel_cfg, seed=1234)
    tp_group, pp_group = parallel.tp_group(), parallel.pp_group()
    tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    models = builder.build_policy_and_reference(model_cfg, parallel_cfg)
    full_state = state.full_state_dict(models.policy, model_cfg.vocab_size, False, tp_group, pp_group)
    state.load_full_state_dict(models.policy, full_state, False, tp_rank, tp_size)
    batch_size = tokens.shape[0]
    results = []
    for eps, fused in settings:
        weight = full_state["output_layer.weight"]
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
        reference_weight = (weight.double() + eps * noise / weight.shape[1] ** 0.5).to(weight.dtype)
        state.load_full_state_dict(
            models.reference, {**full_state, "output_layer.weight": reference_weight}, False, tp_rank, tp_size
        )
        vocab = pipeline.VocabOptions(vocab_size=model_cfg.vocab_size, temperature=1.0, chunk_size=5, fused=fused)
        batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=loss_mask)
        reference = pipeline.compute_token_stats(models.reference, batch, 2, vocab, capture_hidden=True)
        batch.reference_hidden = reference.hidden
        old = pipeline.compute_token_stats(
            models.policy, batch, 2, vocab, reference=output_head.ReferenceHead(models.reference), capture_hidden=True
        )
        assert old.hidden.shape[0] == batch_size
        results.append(
            {
                "eps": eps,
                "fused": fused,
                "kl": old.kl,
                "hidden": old.hidden,
                "reference_hidden": reference.hidden,
                "weight": weight,
                "reference_weight": reference_weight,
            }
        )
    return results


class _PoisonedLoss(_SFTLikeLoss):
    """The SFT-like loss, times NaN when ``poisoned``: every gradient entry becomes NaN."""

    row_separable = False

    def __init__(self, batch_size: int, poisoned: bool):
        super().__init__(batch_size)
        self.poisoned = poisoned

    def __call__(self, stats, mb):
        loss, metrics = super().__call__(stats, mb)
        return (loss * float("nan") if self.poisoned else loss), metrics


def nonfinite_step_worker(rank, world, model_cfg: ModelConfig, parallel_cfg: ParallelConfig, tokens, loss_mask):
    """train_step with a NaN gradient, then a finite one: the first must leave weights, optimizer and LR
    schedule untouched on every rank."""
    torch.manual_seed(0)
    parallel.initialize(model_cfg, parallel_cfg, seed=1234)
    tp_group, pp_group = parallel.tp_group(), parallel.pp_group()
    models = builder.build_policy_and_reference(model_cfg, parallel_cfg)
    train = optim.build_train_state(models.policy, optim.OptimConfig(lr=1e-3, lr_decay_style="linear", decay_steps=4))
    batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=loss_mask)
    vocab = pipeline.VocabOptions(vocab_size=model_cfg.vocab_size)
    inner = [c.module for c in train.chunks]

    def weights():
        return state.full_state_dict(inner, model_cfg.vocab_size, False, tp_group, pp_group)

    before, lr_before = weights(), train.optimizer.param_groups[0]["lr"]
    bad = optim.train_step(train, batch, 2, _PoisonedLoss(tokens.shape[0], True), vocab)
    after_bad, lr_after_bad = weights(), train.optimizer.param_groups[0]["lr"]
    good = optim.train_step(train, batch, 2, _PoisonedLoss(tokens.shape[0], False), vocab)
    after_good = weights()
    return {
        "bad": {"update_successful": bad.update_successful, "grad_norm": bad.grad_norm},
        "good": {"update_successful": good.update_successful, "grad_norm": good.grad_norm},
        "unchanged": all(torch.equal(before[k], after_bad[k]) for k in before),
        "changed_after_good": any(not torch.equal(before[k], after_good[k]) for k in before),
        "finite_after_good": all(torch.isfinite(v).all() for v in after_good.values()),
        "lr": (lr_before, lr_after_bad),
    }


def hung_rank_worker(rank, world, model_cfg: ModelConfig, timeout_s: float):
    """Rank 1 never joins a TP all-reduce: rank 0 must get an error after ``timeout_s``, not hang."""
    parallel.initialize(model_cfg, ParallelConfig(tensor_parallel=world, distributed_timeout_s=timeout_s))
    if rank == 1:
        time.sleep(3 * timeout_s)
        return {"hung": True}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=parallel.tp_group())
    except Exception as err:  # noqa: BLE001 - the timeout is the point
        return {"error": type(err).__name__, "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def adam_kernel_worker(
    rank, world, model_cfg: ModelConfig, tokens, loss_mask, optim_cfg: optim.OptimConfig, steps: int
):
    """``steps`` training steps from a seeded init; returns the optimizer's float32 main parameters, its
    ``fused`` flags and how often torch's fused Adam kernels ran."""
    if torch.cuda.is_available():  # two runs compared bit-near: no atomics-ordered reductions (embedding backward)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    calls = collections.Counter()
    for name in ("_fused_adam_", "_fused_adamw_"):
        kernel = getattr(torch, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        setattr(torch, name, counted)
    torch.manual_seed(0)
    parallel.initialize(model_cfg, ParallelConfig(), seed=1234)
    chunks = builder.build_policy_and_reference(model_cfg, ParallelConfig()).policy
    train = optim.build_train_state(chunks, optim_cfg)
    batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=loss_mask)
    vocab = pipeline.VocabOptions(vocab_size=model_cfg.vocab_size, temperature=0.8, chunk_size=7)
    start = [p.detach().clone() for g in train.optimizer.param_groups for p in g["params"]]
    for _ in range(steps):
        optim.train_step(train, batch, 2, _SFTLikeLoss(tokens.shape[0]), vocab)
    inner = optim.torch_optimizers(train.optimizer)
    return {
        "start": start,
        "main": [p.detach().clone() for g in train.optimizer.param_groups for p in g["params"]],
        "main_dtypes": sorted({str(p.dtype) for g in train.optimizer.param_groups for p in g["params"]}),
        "fused_flags": sorted({bool(g["fused"]) for o in inner for g in o.param_groups}),
        "fused_calls": sum(calls.values()),
    }
