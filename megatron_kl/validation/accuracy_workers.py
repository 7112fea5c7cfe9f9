"""Rank functions for the accuracy tests: fp32 inputs built identically on every rank and in the parent,
each rank computing on its vocabulary slice (its rows of the output weight for the fused linear path)."""

import torch
import torch.distributed as dist

from megatron_kl.local_ranks import to_device
from megatron_kl.validation.devices import rank_device
from megatron_kl.vocab_parallel.fused_linear import fused_linear_grads, fused_linear_stats
from megatron_kl.vocab_parallel.stats import full_kl, fused_stats


def near_reference_inputs(case: dict) -> dict:
    """Policy logits 2*randn and reference = policy + eps * noise (the start of an RL run), as fp32 values;
    for the fused linear path the same through h @ W^T with W_ref = W + eps * noise / sqrt(H)."""
    g = torch.Generator().manual_seed(case["seed"])
    rows, vocab, hidden, eps = case["rows"], case["vocab"], case["hidden"], case["eps"]
    if case["api"].startswith("fused_linear"):
        h = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
        w = 2.0 * torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5
        w_ref = w + eps * torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5
        return {
            "hidden": h.float(),
            "weight": w.float(),
            "reference_weight": w_ref.float(),
            "weights": torch.rand(rows, generator=g, dtype=torch.float64) + 0.5,
        }
    x = 2.0 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    y = x + eps * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    return {
        "logits": x.float(),
        "reference": y.float(),
        "targets": torch.randint(0, vocab, (rows,), generator=g),
        "weights": torch.rand(rows, generator=g, dtype=torch.float64) + 0.5,
    }


def near_reference_worker(rank, world, cases):
    """Exact KL per row and the gradient of sum_t w_t KL_t, by API, on this rank's slice."""
    group = dist.group.WORLD
    results = []
    for case in cases:
        data = to_device(near_reference_inputs(case), rank_device())
        tau = case["temperature"]
        weights = data["weights"].float()
        if case["api"].startswith("fused_linear"):
            h = data["hidden"].clone().requires_grad_(True)
            w = data["weight"].chunk(world, 0)[rank].contiguous().requires_grad_(True)
            w_ref = data["reference_weight"].chunk(world, 0)[rank].contiguous()
            if case["api"] == "fused_linear_single_pass":
                out, grad_h, grad_w = fused_linear_grads(
                    h.detach(),
                    w.detach(),
                    h.detach(),
                    w_ref,
                    None,
                    group,
                    tau,
                    None,
                    case["chunk"],
                    lambda out, lo, hi: (None, None, weights[lo:hi]),
                )
                dist.all_reduce(grad_h, group=group)  # the output layer's TP collective
                results.append({"kl": out[2].double(), "grad_hidden": grad_h.double(), "grad_weight": grad_w.double()})
                continue
            stats = fused_linear_stats(
                h,
                w,
                group,
                reference_hidden=h.detach(),
                reference_weight=w_ref,
                temperature=tau,
                chunk_size=case["chunk"],
            )
            grad_h, grad_w = torch.autograd.grad((weights * stats.kl).sum(), (h, w))
            results.append(
                {"kl": stats.kl.detach().double(), "grad_hidden": grad_h.double(), "grad_weight": grad_w.double()}
            )
            continue
        x = data["logits"].chunk(world, -1)[rank].contiguous().requires_grad_(True)
        y = data["reference"].chunk(world, -1)[rank].contiguous()
        if case["api"] == "full_kl":
            kl = full_kl(x, y, group, temperature=tau, chunk_size=case["chunk"])
        else:  # fused_stats: log-prob and entropy computed in the same pass
            kl = fused_stats(
                x, group, targets=data["targets"], reference_logits=y, temperature=tau, chunk_size=case["chunk"]
            ).kl
        (grad,) = torch.autograd.grad((weights * kl).sum(), x)
        results.append({"kl": kl.detach().double(), "grad": grad.double()})
    return results


def logits_inputs(case: dict):
    """fp32 logits of a named kind, targets and loss weights."""
    g = torch.Generator().manual_seed(case["seed"])
    rows, vocab = case["rows"], case["vocab"]
    noise = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    kind = case["kind"]
    logits = {"2randn": 2 * noise, "1e4+2randn": 1e4 + 2 * noise, "1e4randn": 1e4 * noise}[kind]
    targets = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.randn(2, rows, generator=g, dtype=torch.float64)
    return logits.float(), targets, weights.float()


def logprob_entropy_worker(rank, world, cases):
    """Log-probs, entropy and the gradient of sum_t (w0 lp_t + w1 H_t) on this rank's vocabulary slice."""
    group = dist.group.WORLD
    results = []
    for case in cases:
        logits, targets, weights = to_device(logits_inputs(case), rank_device())
        x = logits.chunk(world, -1)[rank].contiguous().requires_grad_(True)
        stats = fused_stats(x, group, targets=targets, temperature=case["temperature"], chunk_size=case.get("chunk"))
        (grad,) = torch.autograd.grad((weights[0] * stats.logprobs + weights[1] * stats.entropy).sum(), x)
        results.append({"logprobs": stats.logprobs.detach(), "entropy": stats.entropy.detach(), "grad": grad})
    return results
