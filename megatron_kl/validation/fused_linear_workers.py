"""Rank function for the fused linear tests: each rank holds a vocabulary shard of the output weights
(and, with sequence parallelism, a sequence shard of the hidden states)."""

import torch
import torch.distributed as dist

from megatron_kl.local_ranks import to_device
from megatron_kl.validation.devices import rank_device
from megatron_kl.vocab_parallel.fused_linear import fused_linear_grads, fused_linear_stats
from megatron_kl.vocab_parallel.stats import fused_stats


def make_case(case: dict):
    """Full float64 inputs of a case, identical on every rank and in the parent."""
    g = torch.Generator().manual_seed(case["seed"])
    seq, batch, hidden_size, padded = case["seq"], case["batch"], case["hidden"], case["padded_vocab"]
    hidden = torch.randn(seq, batch, hidden_size, generator=g, dtype=torch.float64)
    weight = case["scale"] * torch.randn(padded, hidden_size, generator=g, dtype=torch.float64) / hidden_size**0.5
    reference_hidden = hidden + 0.5 * torch.randn(seq, batch, hidden_size, generator=g, dtype=torch.float64)
    reference_weight = (
        weight
        + case["scale"] * 0.3 * torch.randn(padded, hidden_size, generator=g, dtype=torch.float64) / hidden_size**0.5
    )
    targets = torch.randint(0, case["vocab"], (seq, batch), generator=g)
    weights = torch.randn(3, seq, batch, generator=g, dtype=torch.float64)
    mask = torch.rand(seq, batch, generator=g) > 0.3
    return dict(
        hidden=hidden,
        weight=weight,
        reference_hidden=reference_hidden,
        reference_weight=reference_weight,
        targets=targets,
        weights=weights,
        mask=mask,
    )


def _loss(stats, weights, mask):
    dtype = stats.entropy.dtype
    m = mask.to(dtype)
    return (
        (weights[0].to(dtype) * stats.logprobs + weights[1].to(dtype) * stats.entropy + weights[2].to(dtype) * stats.kl)
        * m
    ).sum()


def fused_linear_worker(rank, world, cases):
    group = dist.group.WORLD
    results = []
    for case in cases:
        full = to_device(make_case(case), rank_device())
        dtype = getattr(torch, case["dtype"])
        sp = case.get("sequence_parallel", False) and world > 1
        hidden_full = full["hidden"].to(dtype)
        local_hidden = (hidden_full.chunk(world, dim=0)[rank] if sp else hidden_full).contiguous().requires_grad_(True)
        local_weight = full["weight"].chunk(world, dim=0)[rank].to(dtype).contiguous().requires_grad_(True)
        ref_hidden = full["reference_hidden"].to(dtype)
        local_ref_hidden = (ref_hidden.chunk(world, dim=0)[rank] if sp else ref_hidden).contiguous()
        local_ref_weight = full["reference_weight"].chunk(world, dim=0)[rank].to(dtype).contiguous()
        kwargs = dict(temperature=case["temperature"], vocab_size=case["vocab"])
        stats = fused_linear_stats(
            local_hidden,
            local_weight,
            group,
            targets=full["targets"],
            reference_hidden=local_ref_hidden,
            reference_weight=local_ref_weight,
            chunk_size=case["chunk"],
            sequence_parallel=sp,
            mask=full["mask"] if case.get("use_mask") else None,
            **kwargs,
        )
        grad_hidden, grad_weight = torch.autograd.grad(
            _loss(stats, full["weights"], full["mask"]), (local_hidden, local_weight)
        )
        result = {
            "logprobs": stats.logprobs.detach().double(),
            "entropy": stats.entropy.detach().double(),
            "kl": stats.kl.detach().double(),
            "grad_hidden": grad_hidden.double(),
            "grad_weight": grad_weight.double(),
        }
        # the unfused path on the same inputs: materialised local logits, then the vocab-parallel stats
        h = hidden_full.detach().requires_grad_(True)
        w = local_weight.detach().requires_grad_(True)
        logits = h @ w.t()
        reference_logits = ref_hidden @ local_ref_weight.t()
        unfused = fused_stats(logits, group, targets=full["targets"], reference_logits=reference_logits, **kwargs)
        loss = _loss(unfused, full["weights"], full["mask"])
        grad_h, grad_w = torch.autograd.grad(loss, (h, w))
        dist.all_reduce(grad_h, group=group)  # the column-parallel layer's backward all-reduce
        result.update(
            unfused_entropy=unfused.entropy.detach().double(),
            unfused_kl=unfused.kl.detach().double(),
            unfused_grad_hidden=grad_h.double(),
            unfused_grad_weight=grad_w.double(),
        )
        results.append(result)
    return results


def single_pass_worker(rank, world, cases):
    """The single pass (gradients formed in the forward through a probe) against autograd through
    ``fused_linear_stats`` on the same row-separable loss: sum_t w0 lp + w1 H + w2 KL + 0.3 w0 exp(lp)."""
    group = dist.group.WORLD
    results = []
    for case in cases:
        full = to_device(make_case(case), rank_device())
        dtype = getattr(torch, case["dtype"])
        hidden = full["hidden"].to(dtype)
        weight = full["weight"].chunk(world, dim=0)[rank].to(dtype).contiguous()
        ref_hidden = full["reference_hidden"].to(dtype)
        ref_weight = full["reference_weight"].chunk(world, dim=0)[rank].to(dtype).contiguous()
        w = full["weights"].reshape(3, -1).to(dtype)
        kwargs = dict(temperature=case["temperature"], vocab_size=case["vocab"])

        h = hidden.clone().requires_grad_(True)
        wt = weight.clone().requires_grad_(True)
        stats = fused_linear_stats(
            h,
            wt,
            group,
            targets=full["targets"],
            reference_hidden=ref_hidden,
            reference_weight=ref_weight,
            chunk_size=case["chunk"],
            **kwargs,
        )
        lp, ent, kl = (x.reshape(-1) for x in (stats.logprobs, stats.entropy, stats.kl))
        loss = (w[0] * lp + w[1] * ent + w[2] * kl + 0.3 * w[0] * torch.exp(lp)).sum()
        want_h, want_w = torch.autograd.grad(loss, (h, wt))

        calls = []

        def probe(out, lo, hi):
            assert (out[:, hi:] == 0).all(), "the probe must see only finished rows"
            calls.append((lo, hi))
            return w[0, lo:hi] * (1 + 0.3 * torch.exp(out[0, lo:hi].to(dtype))), w[1, lo:hi], w[2, lo:hi]

        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        out, got_h, got_w = fused_linear_grads(
            rows,
            weight,
            ref_hidden.reshape(-1, hidden.shape[-1]).contiguous(),
            ref_weight,
            full["targets"].reshape(-1),
            group,
            case["temperature"],
            case["vocab"],
            case["chunk"],
            probe,
        )
        if world > 1:
            dist.all_reduce(got_h, group=group)  # what the output layer's TP collective does in backward
        results.append(
            {
                "stats": torch.stack([lp, ent, kl]).detach().double(),
                "single_stats": out.double(),
                "grad_hidden": want_h.reshape(-1, hidden.shape[-1]).double(),
                "single_grad_hidden": got_h.double(),
                "grad_weight": want_w.double(),
                "single_grad_weight": got_w.double(),
                "probes": len(calls),
            }
        )
    return results
