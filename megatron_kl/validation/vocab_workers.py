"""Rank function for the vocab-parallel tests: every case computed on this rank's vocabulary slice."""

import torch
import torch.distributed as dist

from megatron_kl.local_ranks import to_device
from megatron_kl.validation.devices import rank_device
from megatron_kl.vocab_parallel.stats import entropy, full_kl, fused_stats, token_logprobs


def make_case(case: dict):
    """Full (unsharded) inputs of a case, identical on every rank and in the parent."""
    g = torch.Generator().manual_seed(case["seed"])
    shape = (case["batch"], case["seq"], case["padded_vocab"])
    logits = case["scale"] * torch.randn(shape, generator=g, dtype=torch.float64)
    reference = case["scale"] * torch.randn(shape, generator=g, dtype=torch.float64)
    targets = torch.randint(0, case["vocab"], shape[:2], generator=g)
    weights = torch.randn(3, *shape[:2], generator=g, dtype=torch.float64)
    mask = torch.rand(shape[:2], generator=g) > 0.3
    targets[~mask] = -100  # ignored positions carry a sentinel id, as data loaders do
    return logits, reference, targets, weights, mask


def vocab_parallel_worker(rank, world, cases):
    group = dist.group.WORLD
    results = []
    for case in cases:
        logits, reference, targets, weights, mask = to_device(make_case(case), rank_device())
        dtype = getattr(torch, case["dtype"])
        local = logits.chunk(world, dim=-1)[rank].to(dtype).contiguous().requires_grad_(True)
        local_ref = reference.chunk(world, dim=-1)[rank].to(dtype).contiguous()
        kwargs = dict(temperature=case["temperature"], vocab_size=case["vocab"], chunk_size=case["chunk"])
        if case["fused"]:
            source = local
            if case.get("inplace"):
                source = local * 1.0  # a temporary, as the output layer's logits are
            stats = fused_stats(
                source,
                group,
                targets=targets,
                reference_logits=local_ref,
                inplace_backward=case.get("inplace", False),
                **kwargs,
            )
            lp, ent, kl = stats.logprobs, stats.entropy, stats.kl
        else:
            lp = token_logprobs(local, targets, group, **kwargs)
            ent = entropy(local, group, **kwargs)
            kl = full_kl(local, local_ref, group, **kwargs)
        m = mask.to(lp.dtype)
        loss = ((weights[0].to(lp.dtype) * lp + weights[1].to(lp.dtype) * ent + weights[2].to(lp.dtype) * kl) * m).sum()
        (grad,) = torch.autograd.grad(loss, local)
        results.append(
            {
                "logprobs": lp.detach().double(),
                "entropy": ent.detach().double(),
                "kl": kl.detach().double(),
                "grad": grad.double(),
            }
        )
    return results
