"""Rank functions of the Triton-kernel tests: each wraps a worker and reports which path computed it."""

import torch
import torch.distributed as dist

from megatron_kl.local_ranks import to_device
from megatron_kl.validation.devices import rank_device
from megatron_kl.vocab_parallel import triton_stats
from megatron_kl.vocab_parallel.stats import fused_stats


def through_triton(worker, rank, world, *args):
    """``worker``'s result on this rank, with the number of Triton launches it made (the test asserts > 0)."""
    before = dict(triton_stats.launches)
    result = worker(rank, world, *args)
    launched = {key: triton_stats.launches[key] - before[key] for key in before}
    return {
        "result": result,
        "launches": launched,
        "enabled": triton_stats.enabled(torch.empty(0, device=rank_device())),
    }


def edge_inputs(case: dict):
    """Full inputs of an edge case (identical on every rank): -inf entries, masked rows, extreme scales."""
    g = torch.Generator().manual_seed(case["seed"])
    shape = (case["rows"], case["padded_vocab"])
    logits = case["scale"] * torch.randn(shape, generator=g, dtype=torch.float64)
    reference = logits + case["gap"] * torch.randn(shape, generator=g, dtype=torch.float64)
    vocab = case["vocab"]
    if case.get("masked_tokens"):  # tokens both models exclude, and tokens only the policy excludes
        both = torch.rand(shape, generator=g) < 0.3
        policy_only = (torch.rand(shape, generator=g) < 0.1) & ~both
        both[:, 0] = policy_only[:, 0] = False  # every row keeps a token
        logits[both | policy_only] = float("-inf")
        reference[both] = float("-inf")
    targets = torch.randint(0, vocab, (case["rows"],), generator=g)
    if case.get("masked_tokens"):
        finite = torch.isfinite(logits[:, :vocab])
        targets = torch.where(finite.gather(1, targets[:, None])[:, 0], targets, torch.zeros_like(targets))
    if case.get("all_masked"):
        targets[:] = -100
    weights = torch.randn(3, case["rows"], generator=g, dtype=torch.float64)
    weights[0, targets < 0] = 0.0  # a masked row's log-prob is not part of any loss (its value is unspecified)
    return logits, reference, targets, weights


def edge_worker(rank, world, cases):
    results = []
    for case in cases:
        logits, reference, targets, weights = to_device(edge_inputs(case), rank_device())
        dtype = getattr(torch, case["dtype"])
        local = logits.chunk(world, dim=-1)[rank].to(dtype).contiguous().requires_grad_(True)
        local_ref = reference.chunk(world, dim=-1)[rank].to(dtype).contiguous()
        stats = fused_stats(
            local,
            dist.group.WORLD,
            targets=targets,
            reference_logits=local_ref,
            temperature=case["temperature"],
            vocab_size=case["vocab"],
        )
        w = weights.to(stats.kl.dtype)
        loss = (w[0] * stats.logprobs + w[1] * stats.entropy + w[2] * stats.kl).sum()
        (grad,) = torch.autograd.grad(loss, local) if case["rows"] else (torch.zeros_like(local),)
        results.append(
            {
                "logprobs": stats.logprobs.detach().double(),
                "entropy": stats.entropy.detach().double(),
                "kl": stats.kl.detach().double(),
                "grad": grad.double(),
            }
        )
    return results


class _RecordedKernel:
    """A kernel whose launches are written down (name, argument types, constexprs, warps) before they run."""

    def __init__(self, name, kernel, calls):
        self.name, self.kernel, self.calls = name, kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime.jit import mangle_type

            options = {key: kwargs.pop(key) for key in ("num_warps", "enable_fp_fusion") if key in kwargs}
            names = self.kernel.arg_names
            signature = {name: mangle_type(arg) for name, arg in zip(names, args)}
            self.calls.append(
                {"kernel": self.name, "signature": signature, "constexprs": dict(kwargs), "options": options}
            )
            return self.kernel[grid](*args, **kwargs, **options)

        return launch


class _Recorder:
    def __init__(self, module, calls):
        self.module, self.calls = module, calls

    def __getattr__(self, name):
        return _RecordedKernel(name, getattr(self.module, name), self.calls)


def launch_worker(rank, world, cases):
    """Every kernel launch the dispatcher makes for ``cases`` (the edge cases, with and without a truncated
    support): ``[{kernel, signature {arg: Triton type}, constexprs {name: value}, options}]``."""
    from megatron_kl.vocab_parallel.truncation import Truncation

    calls = []
    kernels = triton_stats._kernels
    triton_stats._kernels = lambda: _Recorder(kernels(), calls)
    try:
        for case in cases:
            logits, reference, targets, _ = to_device(edge_inputs(case), rank_device())
            dtype = getattr(torch, case["dtype"])
            local = logits.chunk(world, dim=-1)[rank].to(dtype).contiguous().requires_grad_(True)
            local_ref = reference.chunk(world, dim=-1)[rank].to(dtype).contiguous()
            for truncation in (None, Truncation(top_k=7, top_p=0.9)):
                stats = fused_stats(
                    local,
                    dist.group.WORLD,
                    targets=targets,
                    reference_logits=local_ref,
                    temperature=case["temperature"],
                    vocab_size=case["vocab"],
                    truncation=truncation,
                )
                if case["rows"]:
                    (stats.logprobs.sum() + stats.entropy.sum() + stats.kl.sum()).backward()
    finally:
        triton_stats._kernels = kernels
    return calls
