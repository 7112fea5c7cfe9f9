"""Rank function of the truncation tests: supports and truncated statistics on this rank's vocabulary slice."""

import torch
import torch.distributed as dist

from megatron_kl.local_ranks import to_device
from megatron_kl.validation.devices import rank_device
from megatron_kl.vocab_parallel.fused_linear import fused_linear_stats
from megatron_kl.vocab_parallel.stats import fused_stats
from megatron_kl.vocab_parallel.truncation import Truncation, support_threshold


def make_case(case: dict):
    """Full inputs of a case (identical on every rank and in the parent): logits [n, V] or, for the fused
    linear path, hidden [n, H] and weight [V, H] with logits = hidden @ weight^T; reference likewise."""
    g = torch.Generator().manual_seed(case["seed"])
    n, padded = case["rows"], case["padded_vocab"]
    kind = case.get("kind", "random")
    if kind == "linear":
        hidden = torch.randn(n, 16, generator=g, dtype=torch.float64)
        weight = case["scale"] * torch.randn(padded, 16, generator=g, dtype=torch.float64) / 4
        ref_hidden = torch.randn(n, 16, generator=g, dtype=torch.float64)
        ref_weight = case["scale"] * torch.randn(padded, 16, generator=g, dtype=torch.float64) / 4
        logits, reference = hidden @ weight.T, ref_hidden @ ref_weight.T
        extra = dict(hidden=hidden, weight=weight, ref_hidden=ref_hidden, ref_weight=ref_weight)
    else:
        if kind == "ties":  # few distinct values: exact ties at every cut
            logits = torch.randint(0, 4, (n, padded), generator=g).double() * case["scale"]
        elif kind == "shard_boundary":  # the first half of the vocabulary holds the support
            logits = torch.randn(n, padded, generator=g, dtype=torch.float64) * 0.01
            logits[:, : padded // 2] += case["scale"]
        else:
            logits = case["scale"] * torch.randn(n, padded, generator=g, dtype=torch.float64)
        reference = case["scale"] * torch.randn(n, padded, generator=g, dtype=torch.float64)
        extra = {}
    weights = torch.randn(3, n, generator=g, dtype=torch.float64)
    return logits, reference, weights, extra


def truncation_worker(rank, world, cases):
    """``case["lookup"]``: the bisection's lookup (``truncation.BISECTION_LOOKUP``); ``case["histogram"]`` False:
    float32 top-p alone by the bisection too (not the CPU's mass histograms)."""
    from megatron_kl.vocab_parallel import top_p_histogram, truncation

    group = dist.group.WORLD
    results = []
    supported = top_p_histogram.supported
    for case in cases:
        truncation.BISECTION_LOOKUP = case.get("lookup", "auto")
        top_p_histogram.supported = supported if case.get("histogram", True) else (lambda x: False)
        logits, reference, weights, extra = to_device(make_case(case), rank_device())
        dtype = getattr(torch, case["dtype"])
        rule = Truncation(case["top_k"], case["top_p"])
        tau, vocab = case["temperature"], case["vocab"]
        targets = torch.as_tensor(case["targets"], device=logits.device)
        local_cols = case["padded_vocab"] // world
        valid = max(0, min(local_cols, vocab - rank * local_cols))
        local = logits.chunk(world, dim=-1)[rank].to(dtype)
        threshold = support_threshold(local[:, :valid], group, rule, tau, vocab)
        if case.get("kind") == "linear":
            hidden = extra["hidden"].to(dtype).requires_grad_(True)
            weight = extra["weight"].chunk(world, dim=0)[rank].to(dtype).contiguous().requires_grad_(True)
            stats = fused_linear_stats(
                hidden,
                weight,
                group,
                targets=targets,
                reference_hidden=extra["ref_hidden"].to(dtype),
                reference_weight=extra["ref_weight"].chunk(world, dim=0)[rank].to(dtype),
                temperature=tau,
                vocab_size=vocab,
                chunk_size=case["chunk"],
                truncation=rule,
            )
            inputs = (hidden, weight)
        else:
            x = local.contiguous().requires_grad_(True)
            stats = fused_stats(
                x,
                group,
                targets=targets,
                reference_logits=reference.chunk(world, dim=-1)[rank].to(dtype),
                temperature=tau,
                vocab_size=vocab,
                chunk_size=case["chunk"],
                truncation=rule,
            )
            inputs = (x,)
        w = weights.to(stats.logprobs.dtype)
        loss = (w[0] * stats.logprobs + w[1] * stats.entropy + w[2] * stats.kl).sum()
        grads = torch.autograd.grad(loss, inputs)
        results.append(
            {
                "support": (local[:, :valid].double() >= threshold.double()[:, None]),
                "logprobs": stats.logprobs.detach().double(),
                "entropy": stats.entropy.detach().double(),
                "kl": stats.kl.detach().double(),
                "kept_mass": stats.kept_mass.double(),
                "support_size": stats.support_size.double(),
                "outside": stats.outside_support.double(),
                "grads": [g.double() for g in grads],
            }
        )
    truncation.BISECTION_LOOKUP, top_p_histogram.supported = "auto", supported
    return results


def histogram_rows(kind: str, seed: int, rows: int = 24, vocab: int = 6000) -> torch.Tensor:
    """float32 rows of a logit shape users meet (full vocabulary; the same in every rank and the parent)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":  # supports of thousands at top-p 0.9
        return 2.0 * torch.randn(rows, vocab, generator=g)
    if kind == "peaked":  # a trained LM's: supports of a few tokens
        return 6.0 * torch.randn(rows, vocab, generator=g)
    if kind == "ties":  # integer logits: thousands of exact ties at every cut
        return torch.randint(0, 5, (rows, vocab), generator=g).float()
    if kind == "large":  # logits ~1e4, close together relative to their size
        return 1e4 + 3.0 * torch.randn(rows, vocab, generator=g)
    if kind == "masked":  # -inf logits (masked tokens), one row of a single finite value, one row all equal
        x = 2.0 * torch.randn(rows, vocab, generator=g)
        x[:, ::3] = float("-inf")
        x[0] = float("-inf")
        x[0, 17] = 1.5
        x[1] = 0.25
        return x
    if kind == "shard_boundary":  # the first half holds almost all the mass: cuts at the shard boundary
        x = 0.01 * torch.randn(rows, vocab, generator=g)
        x[:, : vocab // 2] += 30.0
        return x
    raise ValueError(kind)


def histogram_cut_worker(rank, world, cases, cap, max_levels):
    """support_threshold on this rank's slice of each case's rows, with the mass-histogram search's ``CAP`` and
    ``MAX_LEVELS`` set (a small cap forces narrowing levels; 0 levels leaves every row to the bisection)."""
    from megatron_kl.vocab_parallel import top_p_histogram

    top_p_histogram.CAP, top_p_histogram.MAX_LEVELS = cap, max_levels
    group = dist.group.WORLD if world > 1 else None
    thresholds = []
    for kind, seed, top_p, tau in cases:
        x = histogram_rows(kind, seed)
        local = x.chunk(world, dim=-1)[rank].contiguous()
        assert top_p_histogram.supported(local), "the C kernels did not build"
        thresholds.append(support_threshold(local, group, Truncation(0, top_p), tau, x.shape[-1]))
    return thresholds
