"""The implementations ``tools/bench_vocab_parallel.py --device cuda`` times on one GPU (TP=1), each as
name -> (prepare, bytes): ``prepare()`` makes the fresh inputs and returns the timed forward + backward, and
``bytes`` is what that statistic must move through memory at the least (its floor): log-probs and log-probs +
entropy read the logits once forward, once backward and write the gradient (3 logits tensors); the exact KL
reads both logits tensors forward and backward and writes the gradient (5). A device-to-device copy of one
logits tensor (2 tensors moved) measured in the same rounds gives the bandwidth those bytes are divided by.

Peers: megatron-core's ``vocab_parallel_cross_entropy`` (the baseline), Liger-Kernel's cross entropy and fused
linear cross entropy (log-probs only; where the package is installed), naive torch autograd, this project's
torch path (``MEGATRON_KL_TRITON=0``) and its Triton kernels (the default on CUDA).
"""

from __future__ import annotations

import contextlib
import os

TEMPERATURE = 1.0


@contextlib.contextmanager
def _path(triton: bool):
    """The statistics path for the duration of a run (``MEGATRON_KL_TRITON`` is read at every call)."""
    from megatron_kl.vocab_parallel import triton_stats

    before = os.environ.get(triton_stats.ENV)
    os.environ[triton_stats.ENV] = "1" if triton else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(triton_stats.ENV, None)
        else:
            os.environ[triton_stats.ENV] = before


def _liger():
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    return liger


def logits_paths(logits, reference, targets) -> dict:
    """name -> (prepare, floor bytes) on logits of any dtype (the baseline: ``megatron_core_logprobs``)."""
    import torch

    from megatron_kl.vocab_parallel.stats import fused_stats

    unit = logits.numel() * logits.element_size()

    def copy():
        return lambda: logits.clone()

    def megatron_core():
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        x = logits.clone().requires_grad_(True)
        return lambda: (-vocab_parallel_cross_entropy(x, targets)).sum().backward()

    def liger_logprobs():
        loss = _liger().LigerCrossEntropyLoss(reduction="sum")
        x = logits.clone().requires_grad_(True)
        return lambda: (-loss(x, targets)).backward()

    def ours(triton: bool, entropy=False, kl=False, lp=True):
        x = logits.clone().requires_grad_(True)

        def run():
            with _path(triton):
                stats = fused_stats(
                    x,
                    None,
                    targets=targets if lp else None,
                    reference_logits=reference if kl else None,
                    temperature=TEMPERATURE,
                    inplace_backward=True,
                    entropy=entropy,
                )
                loss = sum(v.float().sum() for v in (stats.logprobs, stats.entropy, stats.kl) if v is not None)
                loss.backward()

        return run

    def naive(entropy=False, kl=False, lp=True):
        x = logits.clone().requires_grad_(True)

        def run():
            logp = torch.log_softmax(x.float() / TEMPERATURE, -1)
            loss = logp.gather(-1, targets[:, None]).sum() if lp else 0.0
            if entropy:
                loss = loss - (logp.exp() * logp).sum()
            if kl:
                logq = torch.log_softmax(reference.float() / TEMPERATURE, -1)
                loss = loss + (logp.exp() * (logp - logq)).sum()
            loss.backward()

        return run

    paths = {"copy": (copy, 2 * unit), "megatron_core_logprobs": (megatron_core, 3 * unit)}
    if _liger() is not None:
        paths["liger_logprobs"] = (liger_logprobs, 3 * unit)
    for triton, prefix in ((True, "triton"), (False, "torch")):
        paths[f"{prefix}_logprobs"] = (lambda t=triton: ours(t), 3 * unit)
        paths[f"{prefix}_logprobs_entropy"] = (lambda t=triton: ours(t, entropy=True), 3 * unit)
        paths[f"{prefix}_exact_kl"] = (lambda t=triton: ours(t, kl=True, lp=False), 5 * unit)
    paths["naive_logprobs"] = (lambda: naive(), 3 * unit)
    paths["naive_logprobs_entropy"] = (lambda: naive(entropy=True), 3 * unit)
    paths["naive_exact_kl"] = (lambda: naive(kl=True, lp=False), 5 * unit)
    return paths


def linear_paths(hidden, weight, reference_weight, targets) -> dict:
    """name -> (prepare, None) for hidden states + output weight in, gradients w.r.t. both (no floor: the GEMMs
    dominate); the baseline ``liger_flce_logprobs`` where Liger is installed, else ``unfused_logprobs_entropy``."""
    import torch

    from megatron_kl.vocab_parallel.fused_linear import fused_linear_stats
    from megatron_kl.vocab_parallel.stats import fused_stats

    def liger_flce():
        loss = _liger().LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def run():
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            torch.autograd.grad(-loss(w, h, targets), (h, w))

        return run

    def unfused(triton: bool):
        def run():
            with _path(triton):
                h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
                stats = fused_stats(h @ w.t(), None, targets=targets, temperature=TEMPERATURE, inplace_backward=True)
                torch.autograd.grad(stats.logprobs.float().sum() + stats.entropy.float().sum(), (h, w))

        return run

    def fused(triton: bool, kl: bool):
        def run():
            with _path(triton):
                h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
                stats = fused_linear_stats(
                    h,
                    w,
                    None,
                    targets=targets,
                    reference_hidden=hidden if kl else None,
                    reference_weight=reference_weight if kl else None,
                    temperature=TEMPERATURE,
                )
                loss = stats.logprobs.float().sum() + stats.entropy.float().sum()
                if kl:
                    loss = loss + stats.kl.float().sum()
                torch.autograd.grad(loss, (h, w))

        return run

    paths = {}
    if _liger() is not None:
        paths["liger_flce_logprobs"] = (liger_flce, None)
    paths.update(
        {
            "unfused_logprobs_entropy": (lambda: unfused(True), None),
            "triton_fused_logprobs_entropy": (lambda: fused(True, False), None),
            "torch_fused_logprobs_entropy": (lambda: fused(False, False), None),
            "triton_fused_lp_entropy_kl": (lambda: fused(True, True), None),
            "torch_fused_lp_entropy_kl": (lambda: fused(False, True), None),
        }
    )
    return paths
