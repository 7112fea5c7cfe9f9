"""Rank function of the context-parallel loss tests: every case's loss, metrics, clamp counts and logits gradient
on this rank's zigzag shard (with the vocabulary sharded over a TP group as well, when asked)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from megatron_kl.algo.losses import AlgoConfig, MicrobatchLoss, Shares
from megatron_kl.kl.audit.exact import all_configs, behavior_configs
from megatron_kl.kl.estimators import ClampCounter
from megatron_kl.kl.objective import kl_penalty_credit
from megatron_kl.kl.rpg import DIVERGENCES, RPGConfig
from megatron_kl.kl.sequence_axis import LOCAL, ContextParallelAxis, zigzag_shard
from megatron_kl.models.batch import Microbatch
from megatron_kl.vocab_parallel.stats import fused_stats

VOCAB = 12
TEMPERATURE = 0.9


def cases() -> list[dict]:
    """(kl, algo) pairs covering every KL configuration of the audit (on- and off-policy, the behaviour-weighted
    ones with each correction in turn), every aggregation, every correction, GSPO, RPG, pi_old from the update."""
    corrections = [
        kind for kind in ("token_tis", "sequence_tis", "token_mask", "sequence_mask", "geometric_mask", "icepop")
    ]
    out = []
    kl_configs = all_configs(True, coef=0.3) + [
        cfg for cfg in all_configs(False, coef=0.3) if cfg.name not in {c.name for c in all_configs(True, coef=0.3)}
    ]
    for kl in kl_configs:
        out.append({"kl": kl, "algo": AlgoConfig(aggregation=kl.aggregation)})
    for i, kl in enumerate(behavior_configs(coef=0.3)):
        out.append({"kl": kl, "algo": AlgoConfig(behavior_correction=corrections[i % len(corrections)])})
    base = all_configs(True, coef=0.3)
    for j, aggregation in enumerate(
        ("seq_mean_token_sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    ):
        for kl in base[j::9]:
            kl = dataclasses.replace(
                kl, aggregation=aggregation, norm_length=7.0 if aggregation.endswith("norm") else None
            )
            out.append({"kl": kl, "algo": AlgoConfig(aggregation=aggregation, norm_length=7.0, entropy_coef=0.01)})
    for kind in corrections:
        out.append({"kl": base[1], "algo": AlgoConfig(behavior_correction=kind, tis_cap=1.5)})
        out.append({"kl": base[2], "algo": AlgoConfig(behavior_correction=kind, ratio_level="sequence")})  # GSPO
    for divergence in DIVERGENCES:
        for surrogate in ("differentiable", "reinforce"):
            clip = {} if surrogate == "reinforce" else {"clip_low": None, "clip_high": None, "dual_clip": None}
            rpg = RPGConfig(divergence=divergence, surrogate=surrogate, coef=0.05, **clip)
            out.append({"kl": dataclasses.replace(base[0], coef=0.0), "algo": AlgoConfig(loss="rpg", rpg=rpg)})
    for kl in base[::11]:
        out.append({"kl": kl, "algo": AlgoConfig(old_logprobs="from_update"), "from_update": True})
    for kl in [cfg for cfg in base if cfg.estimator != "full"][::5]:  # clamped log-ratios, per token and per sequence
        out.append({"kl": dataclasses.replace(kl, clamp=0.05), "algo": AlgoConfig()})
    return out


def inputs(seed: int, batch: int, length: int, dtype=torch.float64) -> dict:
    """Whole sequences [B, T] (T not a multiple of 2 cp): prompts of varied length, responses starting anywhere
    (mid-chunk), a one-token response, an empty one; policy logits near the reference and the sampler."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch, length, VOCAB, generator=g, dtype=torch.float64)
    reference = logits + 0.3 * torch.randn(batch, length, VOCAB, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (batch, length), generator=g)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        start = int(torch.randint(0, length - 1, (1,), generator=g))
        stop = length - int(torch.randint(0, 3, (1,), generator=g))
        mask[b, start : max(start + 1, stop)] = True
    mask[0] = False
    mask[0, length // 2] = True  # a one-token response
    mask[-1] = False  # an empty response
    old = torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.3
    behavior = torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.1
    advantages = torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, length).contiguous()
    return {
        "logits": logits.to(dtype),
        "reference": reference.to(dtype),
        "targets": targets,
        "mask": mask,
        "old_shift": old.to(dtype),
        "behavior_shift": behavior.to(dtype),
        "advantages": advantages.to(dtype),
    }


def _case_losses(data: dict, axis, tp_group, tp_size: int, tp_rank: int) -> list[dict]:
    """Every case on this rank's tensors (already sharded along the sequence, full vocabulary)."""
    results = []
    per_rank = VOCAB // tp_size
    columns = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    mask = data["mask"]
    num_tokens = float(axis.total(mask.to(torch.float64)))
    shares = Shares(num_sequences=mask.shape[0], num_tokens=num_tokens)
    for case in cases():
        kl, algo = case["kl"], case["algo"]
        logits = data["logits"][..., columns].clone().requires_grad_(True)
        reference = data["reference"][..., columns]
        stats = fused_stats(
            logits,
            tp_group,
            targets=data["targets"],
            reference_logits=reference,
            temperature=TEMPERATURE,
            vocab_size=VOCAB,
        )
        with torch.no_grad():
            old = stats.logprobs.detach() + data["old_shift"]
            behavior = old + data["behavior_shift"]
            old_kl = stats.kl.detach() * (1.0 + data["old_shift"].abs())
        counter = ClampCounter()
        reference_logprobs = stats.logprobs.detach() - data["old_shift"] * 0.5
        mb = Microbatch(
            tokens=torch.zeros(mask.shape, dtype=torch.long),
            loss_mask=mask.to(logits.dtype),
            behavior_logprobs=behavior,
            reference_logprobs=reference_logprobs,
            advantages=data["advantages"],
        )
        if not case.get("from_update"):
            mb.old_logprobs = old
        if kl.coef > 0 and kl.placement == "reward" and not case.get("from_update"):
            mb.kl_returns = -kl.coef * kl_penalty_credit(
                kl, old, reference_logprobs, mask, behavior, full_kl=old_kl, counter=counter, axis=axis
            )
        loss_fn = MicrobatchLoss(algo=algo, kl=kl, shares=shares, counter=counter, axis=axis)
        loss, metrics = loss_fn(stats, mb)
        (grad,) = torch.autograd.grad(loss * axis.share, logits, allow_unused=True)
        if grad is None:
            grad = torch.zeros_like(logits)
        results.append(
            {
                "loss": float(loss.detach()),
                "grad": grad.detach(),
                "metrics": {k: float(v) for k, v in metrics.items()},
                "counts": dict(counter.counts),
            }
        )
    return results


def single_rank(seed: int, batch: int, length: int, dtype_name: str) -> list[dict]:
    """The reference: whole sequences on one rank (no process group)."""
    data = inputs(seed, batch, length, getattr(torch, dtype_name))
    return _case_losses(data, LOCAL, None, 1, 0)


def cp_worker(rank: int, world: int, cp: int, tp: int, seed: int, batch: int, length: int, dtype_name: str):
    """Rank ``rank`` = cp_rank * tp + tp_rank of a CP x TP grid: its cases on its zigzag shard."""
    assert cp * tp == world
    cp_rank, tp_rank = divmod(rank, tp)
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    tp_group = tp_groups[cp_rank]
    axis = ContextParallelAxis(cp_groups[tp_rank], cp, cp_rank)
    data = inputs(seed, batch, length, getattr(torch, dtype_name))
    sharded = {}
    for key, value in data.items():
        moved = value.movedim(1, -1)  # the sequence last: [B, (V,) T]
        pad = 0 if key != "mask" else False
        sharded[key] = zigzag_shard(moved, cp, cp_rank, pad).movedim(-1, 1).contiguous()
    results = _case_losses(sharded, axis, tp_group, tp, tp_rank)
    return {"cp_rank": cp_rank, "tp_rank": tp_rank, "results": results}


def total_cases() -> int:
    return len(cases())


def relative(a: float, b: float) -> float:
    return abs(a - b) / (1.0 + abs(b)) if math.isfinite(b) else (0.0 if a == b else math.inf)
