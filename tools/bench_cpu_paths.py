"""The implementations tools/bench_vocab_parallel.py times on CPU tensors, each a name -> a callable over the same
inputs: megatron-core's and this package's vocab-parallel log-probs, entropy and exact KL from logits, the fused
linear + statistics paths from hidden states, and the truncated (top-k / top-p) statistics (the CUDA ones are in
tools/bench_gpu_paths.py)."""

from __future__ import annotations

TEMPERATURE = 1.0
TRUNCATIONS = {"full_stats": None, "top_k50_top_p0.95": (50, 0.95), "top_p0.9": (0, 0.9), "top_k20": (20, 1.0)}


def logits_inputs(tokens: int, vocab: int, world: int, rank: int, scale: float = 2.0, device: str = "cpu"):
    import torch

    g = torch.Generator().manual_seed(0)
    logits = scale * torch.randn(tokens, vocab, generator=g)
    reference = logits + 0.05 * torch.randn(tokens, vocab, generator=g)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    local = vocab // world
    sl = slice(rank * local, (rank + 1) * local)
    return (logits[:, sl].contiguous().to(device), reference[:, sl].contiguous().to(device), targets.to(device))


def truncation_paths(
    tokens: int, vocab: int, chunk, group, world: int, rank: int, scale: float, device: str = "cpu"
) -> dict:
    """name -> prepare() for log-prob + entropy + exact KL, full and truncated (``TRUNCATIONS``), in place."""
    from megatron_kl.vocab_parallel.stats import fused_stats
    from megatron_kl.vocab_parallel.truncation import Truncation

    logits, reference, targets = logits_inputs(tokens, vocab, world, rank, scale, device)

    def prepare(rule):
        x = logits.clone().requires_grad_(True)

        def run():
            stats = fused_stats(
                x,
                group,
                targets=targets,
                reference_logits=reference,
                chunk_size=chunk,
                inplace_backward=True,
                truncation=None if rule is None else Truncation(*rule),
            )
            (stats.logprobs.sum() + stats.entropy.sum() + stats.kl.sum()).backward()

        return run

    return {name: (lambda rule=rule: prepare(rule)) for name, rule in TRUNCATIONS.items()}


def truncation_linear_paths(tokens: int, vocab: int, hidden_size: int, scale: float, chunk) -> dict:
    """name -> prepare() for the fused-linear path (hidden + output weight in, grads w.r.t. both), full and
    truncated (``TRUNCATIONS``), logits ~ ``scale`` x N(0, 1) as in ``truncation_paths``."""
    import torch

    from megatron_kl.vocab_parallel.fused_linear import fused_linear_stats
    from megatron_kl.vocab_parallel.truncation import Truncation

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    weight = scale * torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    reference_weight = weight + 0.05 * torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    targets = torch.randint(0, vocab, (tokens,), generator=g)

    def prepare(rule):
        def run():
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            stats = fused_linear_stats(
                h,
                w,
                None,
                targets=targets,
                reference_hidden=hidden,
                reference_weight=reference_weight,
                temperature=TEMPERATURE,
                chunk_size=chunk,
                truncation=None if rule is None else Truncation(*rule),
            )
            torch.autograd.grad(stats.logprobs.sum() + stats.entropy.sum() + stats.kl.sum(), (h, w))

        return run

    return {name: (lambda rule=rule: prepare(rule)) for name, rule in TRUNCATIONS.items()}


def logits_paths_cpu(tokens: int, vocab: int, chunk, group, world: int, rank: int, device: str = "cpu") -> dict:
    """name -> prepare(); prepare() makes the fresh input copy and returns the timed fwd+bwd closure."""
    import torch

    from megatron_kl.vocab_parallel.stats import fused_stats

    logits, reference, targets = logits_inputs(tokens, vocab, world, rank, device=device)

    def megatron_core():
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        x = logits.clone().requires_grad_(True)
        return lambda: (-vocab_parallel_cross_entropy(x, targets)).sum().backward()

    def ours(entropy=False, kl=False, inplace=True, lp=True):
        x = logits.clone().requires_grad_(True)

        def run():
            stats = fused_stats(
                x,
                group,
                targets=targets if lp else None,
                reference_logits=reference if kl else None,
                temperature=TEMPERATURE,
                chunk_size=chunk,
                inplace_backward=inplace,
                entropy=entropy,
            )
            loss = sum(v.sum() for v in (stats.logprobs, stats.entropy, stats.kl) if v is not None)
            loss.backward()

        return run

    def naive(entropy=False, kl=False, lp=True):
        x = logits.clone().requires_grad_(True)

        def run():
            logp = torch.log_softmax(x / TEMPERATURE, -1)
            loss = logp.gather(-1, targets[:, None]).sum() if lp else 0.0
            if entropy:
                loss = loss - (logp.exp() * logp).sum()
            if kl:
                logq = torch.log_softmax(reference / TEMPERATURE, -1)
                loss = loss + (logp.exp() * (logp - logq)).sum()
            loss.backward()

        return run

    paths = {
        "megatron_core_logprobs": megatron_core,
        "logprobs": lambda: ours(),
        "logprobs_no_inplace": lambda: ours(inplace=False),
        "logprobs_entropy": lambda: ours(entropy=True),
        "exact_kl": lambda: ours(kl=True, lp=False),
    }
    if world == 1:
        paths.update(
            {
                "naive_logprobs": lambda: naive(),
                "naive_logprobs_entropy": lambda: naive(entropy=True),
                "naive_exact_kl": lambda: naive(kl=True, lp=False),
            }
        )
    return paths


def linear_paths_cpu(tokens: int, vocab: int, hidden_size: int, chunk, device: str = "cpu") -> dict:
    import torch

    from megatron_kl.vocab_parallel.fused_linear import fused_linear_grads, fused_linear_stats, linear_chunk_rows
    from megatron_kl.vocab_parallel.stats import fused_stats

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).requires_grad_(True)
    reference_hidden = torch.randn(tokens, hidden_size, generator=g)
    reference_weight = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    hidden, reference_hidden, reference_weight, targets = (
        t.to(device) for t in (hidden, reference_hidden, reference_weight, targets)
    )
    weight = weight.detach().to(device).requires_grad_(True)

    def loss_of(stats):
        return stats.logprobs.sum() + stats.entropy.sum() + stats.kl.sum()

    def naive():
        h = hidden.clone().requires_grad_(True)
        logp = torch.log_softmax(h @ weight.t() / TEMPERATURE, -1)
        with torch.no_grad():
            logq = torch.log_softmax(reference_hidden @ reference_weight.t() / TEMPERATURE, -1)
        p = logp.exp()
        loss = logp.gather(-1, targets[:, None]).sum() - (p * logp).sum() + (p * (logp - logq)).sum()
        return torch.autograd.grad(loss, (h, weight))

    def unfused():
        h = hidden.clone().requires_grad_(True)
        logits = h @ weight.t()
        with torch.no_grad():
            reference_logits = reference_hidden @ reference_weight.t()
        stats = fused_stats(
            logits,
            None,
            targets=targets,
            reference_logits=reference_logits,
            temperature=TEMPERATURE,
            inplace_backward=True,
        )
        del reference_logits
        return torch.autograd.grad(loss_of(stats), (h, weight))

    def fused():
        h = hidden.clone().requires_grad_(True)
        stats = fused_linear_stats(
            h,
            weight,
            None,
            targets=targets,
            reference_hidden=reference_hidden,
            reference_weight=reference_weight,
            temperature=TEMPERATURE,
            chunk_size=chunk,
        )
        return torch.autograd.grad(loss_of(stats), (h, weight))

    def single_pass():  # model.fused_grad=in_forward: the loss is row-separable, dL/d(stats) = 1 per row
        ones = torch.ones(tokens, device=device)
        _, grad_hidden, grad_weight = fused_linear_grads(
            hidden,
            weight.detach(),
            reference_hidden,
            reference_weight,
            targets,
            None,
            TEMPERATURE,
            None,
            chunk or linear_chunk_rows(vocab, single_pass=True),
            lambda out, lo, hi: (ones[lo:hi], ones[lo:hi], ones[lo:hi]),
        )
        return grad_hidden, grad_weight

    # prepare() -> run: inputs are shared (nothing is overwritten), the clone happens inside the timed run
    return {
        "naive": lambda: naive,
        "unfused": lambda: unfused,
        "fused_linear": lambda: fused,
        "fused_single_pass": lambda: single_pass,
    }
