"""The GPU path of the vocab-parallel statistics: Triton kernels (``triton_kernels``) behind
``vocab_parallel.chunk_forward`` / ``chunk_grad``, so ``fused_stats``, ``token_logprobs``, ``entropy``,
``full_kl`` and ``fused_linear_stats`` take it without a change of API.

Which path runs (``enabled``): CUDA tensors take the Triton kernels where Triton imports; CPU tensors the torch /
C path. ``MEGATRON_KL_TRITON=0`` forces the torch path on GPU; ``MEGATRON_KL_TRITON=1`` with
``TRITON_INTERPRET=1`` runs the kernels on CPU tensors through Triton's interpreter (how the tests check them
without a GPU; float32 and float64 only - bfloat16 / float16 inputs are upcast to float32 there first).

Per chunk of rows the forward reads each rank's logits once (``row_partials``: running maxima and the partial
sums relative to them), then combines the ranks' partials here with the collectives of the torch path - one
all-reduce MAX of the maxima and one all-reduce SUM of the rescaled partials ([2, n] and [9, n] floats) - and
the backward reads the logits once more and writes the gradient once (``row_grad``; in place when the caller
passes the logits as ``out``). The target's log-prob and whether it lies outside a truncated support come from
one gathered logit per row. The combination runs in float64 ([9, n] values: exact to the partials' rounding).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys

import torch
import torch.distributed as dist

from megatron_kl import env_vars
from megatron_kl.vocab_parallel.chunks import MAX, MEAN_U, MEAN_ZC, SHIFT, SUM, Rows, Sweep, Upstream
from megatron_kl.vocab_parallel.groups import all_reduce

ENV = "MEGATRON_KL_TRITON"
BLOCK_ENV = "MEGATRON_KL_TRITON_BLOCK"
BLOCK = 4096  # columns per step of a program's loop (GPU); smaller powers of two for narrow rows
INTERPRETER_BLOCK = 1024  # the interpreter's numpy arrays: fewer, larger steps are faster
NUM_WARPS = 8
# No fused multiply-add: the forward and the backward must round u = (x - y - shift) / tau alike. Contracted into
# an fma (compiled Triton's default; the interpreter never contracts), the backward's u_a - E[u] differs from the
# forward's by ~eps |u| where tau != 1, and where one token holds the mass that difference is the whole gradient
# (seen on an H100: 1e-4 relative error at logits ~2500, temperature 0.9).
LAUNCH_OPTIONS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}
DRIFT_LIMIT = 1.0  # shift drift (logit / tau units) above which a row's E[u] is read again (triton_kernels docstring)
log = logging.getLogger(__name__)
launches = {"forward": 0, "backward": 0, "mean_u": 0}  # kernel launches in this process (tests check which path ran)

# per compute dtype: below -LOW a logit is read as -LOW (its mass exp(-LOW) is 0; no inf - inf); Taylor terms of
# expm1 below |v| = 1/2 (the truncation error (1/2)^(n+1) / (n+1)! is under the dtype's rounding)
LOW = {torch.float32: 1e30, torch.float64: 1e300}
TAYLOR_TERMS = {torch.float32: 9, torch.float64: 17}


# rows of the globally reduced sums (``_reduce``): S = sum_a e_a, S E[zc], S E[u], sum_a (e_ref - e) (C + D), the
# target's zc, the full softmax's mass outside the support (D), the support's size (K), whether the target lies
# outside it, and whether a row's shifts drifted (its S E[u] read again)
REDUCED = (S, S_ZC, S_U, REF_MINUS_POLICY, TARGET_ZC, DROPPED, SUPPORT_SIZE, TARGET_OUT, DRIFTED) = range(9)
# rows of one rank's row partials (``row_partials``, relative to its own running maxima; ``triton_kernels``
# docstring): the maxima m and n of x and y, S, A, B, C, D, K and the drift G
PARTIALS = (P_MAX, P_REF_MAX, P_S, P_A, P_B, P_C, P_D, P_K, P_G) = range(9)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s statistics run on the Triton kernels (module docstring)."""
    choice = env_vars.switch(ENV)  # off (0/false/no), on (1/true/yes) or auto; anything else names the variable
    if choice == env_vars.OFF:
        return False
    if tensor.device.type == "cuda":
        if not _triton_available():
            if choice == env_vars.ON:
                raise RuntimeError(f"{ENV}=1 but triton is not importable: pip install triton, or set {ENV}=0")
            return False
        return True
    if choice == env_vars.ON and tensor.device.type == "cpu":
        if not _interpreting():
            raise RuntimeError(
                f"{ENV}=1 on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter); unset {ENV} "
                "to use the CPU kernels"
            )
        if not _triton_available():
            raise RuntimeError(f"{ENV}=1 but triton is not importable: pip install triton")
        return True
    return False


def describe(device: torch.device) -> str:
    """One line naming the statistics path for tensors on ``device`` (the trainer logs it once)."""
    probe = torch.empty(0, device=device)
    if enabled(probe):
        import triton

        mode = "Triton interpreter" if _interpreting() else "Triton kernels"
        return f"vocab-parallel statistics: {mode} (triton {triton.__version__}) on {device.type}"
    if device.type == "cuda":
        reason = f"{ENV}={os.environ.get(ENV)}" if env_vars.switch(ENV) == env_vars.OFF else "triton not installed"
        return f"vocab-parallel statistics: torch path on cuda ({reason})"
    return "vocab-parallel statistics: CPU kernels (torch, C top-p search)"


def _kernels():
    """The kernel module, decorated for the current mode (compiled or interpreted)."""
    if _interpreting():
        from triton.language import standard

        if type(standard.zeros).__name__ != "InterpretedFunction":
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton.language had been imported in compiled mode, "
                "so its library functions cannot run in the interpreter: set TRITON_INTERPRET=1 before "
                "the process starts (or before anything imports triton)"
            )
    name = "megatron_kl.vocab_parallel.triton_kernels"
    module = sys.modules.get(name)
    if module is None:
        module = importlib.import_module(name)
        module.INTERPRETED = _interpreting()
    elif module.INTERPRETED != _interpreting():
        module = importlib.reload(module)
        module.INTERPRETED = _interpreting()
    return module


def _block(cols: int) -> int:
    """Columns per loop step: a power of two up to BLOCK (``MEGATRON_KL_TRITON_BLOCK`` overrides the cap: the
    tests use it for rows that span many blocks and end mid-block)."""
    cap = INTERPRETER_BLOCK if _interpreting() else BLOCK
    override = env_vars.power_of_two(BLOCK_ENV, 16)
    if override is not None:
        cap = override
    return max(16, min(cap, 1 << max(0, cols - 1).bit_length()))


@functools.lru_cache(maxsize=64)
def _inverse_temperature(temperature: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """1 / tau as a one-element tensor of the compute dtype: a Python float argument of a compiled kernel is
    float32 (Triton's signature for ``float``), which would round 1 / tau to 2^-24 relative and put that error into
    every float64 statistic (the interpreter keeps the float's 64 bits, so only the GPU would show it)."""
    return torch.full((1,), 1.0 / temperature, dtype=dtype, device=device)


def _kernel_input(x: torch.Tensor, dtype) -> torch.Tensor:
    """``x`` with unit column stride; upcast where the interpreter cannot do its arithmetic."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if _interpreting() and x.dtype not in (torch.float32, torch.float64):
        x = x.to(dtype)
    return x


def forward(rows: Rows, sweep: Sweep, support=None):
    """``vocab_parallel.chunk_forward``'s ``(out [3, n], norms [5, n])`` from the Triton kernels (``rows.x`` /
    ``rows.y``: this rank's valid columns [n, valid], read only; ``support [3, n]`` filled under
    ``rows.threshold``)."""
    x, y, threshold = rows.x, rows.y, rows.threshold
    temperature = sweep.temperature
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    n, cols = x.shape
    device = x.device
    partials = torch.empty(9, n, dtype=dtype, device=device)
    if n:
        xk = _kernel_input(x, dtype)
        yk = _kernel_input(y, dtype) if y is not None else xk
        thr = threshold.to(dtype).contiguous() if threshold is not None else partials
        launches["forward"] += 1
        _kernels().row_partials[(n,)](
            xk,
            yk,
            thr,
            partials,
            xk.stride(0),
            yk.stride(0),
            cols,
            _inverse_temperature(temperature, dtype, device),
            HAS_Y=y is not None,
            ENTROPY=sweep.entropy,
            TRUNCATED=threshold is not None,
            LOW=LOW[dtype],
            TERMS=TAYLOR_TERMS[dtype],
            BLOCK=_block(cols),
            **LAUNCH_OPTIONS,
        )
    return combine(partials, rows, sweep, support)


def combine(partials, rows: Rows, sweep: Sweep, support=None):
    """Every rank's row partials [9, n] (m, n, S, A, B, C, D, K, G relative to its own maxima) of ``rows`` -> the
    globally reduced statistics, rescaled to the global maxima M / M_r (``triton_kernels`` docstring) in float64;
    rows whose shifts drifted get S E[u] from a second read (``_mean_u_again``)."""
    x, targets, threshold, shard, group = rows.x, rows.targets, rows.threshold, sweep.shard, sweep.group
    has_y, entropy, temperature = rows.y is not None, sweep.entropy, sweep.temperature
    dtype = partials.dtype
    n = partials.shape[1]
    p = partials.double()
    maxes = p[[P_MAX, P_REF_MAX]]  # a copy (advanced indexing)
    all_reduce(maxes, dist.ReduceOp.MAX, group)
    inv_tau = 1.0 / temperature
    delta = (p[P_MAX] - maxes[0]) * inv_tau
    alpha = torch.exp(delta)
    sums = torch.zeros(len(REDUCED), n, dtype=torch.float64, device=p.device)
    sums[S] = alpha * p[P_S]
    if entropy:
        sums[S_ZC] = alpha * (p[P_A] + delta * p[P_S])
    if has_y:
        gamma = ((maxes[0] - maxes[1]) - (p[P_MAX] - p[P_REF_MAX])) * inv_tau
        beta = torch.exp((p[P_REF_MAX] - maxes[1]) * inv_tau)
        moved = torch.where(gamma.abs() < 0.5, alpha * torch.expm1(gamma), beta - alpha)
        sums[S_U] = alpha * (p[P_B] - gamma * p[P_S])
        # this rank's E[u] needs a second read
        sums[DRIFTED] = ((p[P_G] + gamma.abs()) * (p[P_S] > 0) > DRIFT_LIMIT).double()
        sums[REF_MINUS_POLICY] = beta * p[P_C] + moved * (p[P_S] + p[P_D]) + alpha * p[P_D]
    sums[DROPPED] = alpha * p[P_D]
    sums[SUPPORT_SIZE] = p[P_K]
    if targets is not None:
        local, owned = shard.owned(targets)
        picked = (
            x.gather(-1, local.clamp(0, max(0, shard.valid - 1)).unsqueeze(-1)).squeeze(-1).double()
            if shard.valid
            else torch.zeros(n, dtype=torch.float64, device=p.device)
        )
        picked = picked.clamp_min(-LOW[dtype])
        sums[TARGET_ZC] = torch.where(owned, (picked - maxes[0]) * inv_tau, torch.zeros_like(picked))
        if threshold is not None:
            sums[TARGET_OUT] = (owned & (picked < threshold.double())).double()
    all_reduce(sums, dist.ReduceOp.SUM, group)
    total = sums[S]
    log_s = torch.log(total)
    out = torch.zeros(3, n, dtype=torch.float64, device=p.device)
    norms = torch.zeros(5, n, dtype=torch.float64, device=p.device)
    norms[MAX], norms[SHIFT], norms[SUM] = maxes[0], maxes[0] - maxes[1], total
    if targets is not None:
        out[0] = sums[TARGET_ZC] - log_s
    if entropy:
        norms[MEAN_ZC] = sums[S_ZC] / total
        out[1] = log_s - norms[MEAN_ZC]
    if has_y:
        drifted = (sums[DRIFTED] > 0).nonzero().squeeze(-1)  # the same rows on every rank (after the all-reduce)
        if drifted.numel():
            sums[S_U, drifted] = _mean_u_again(rows, drifted, norms[[MAX, SHIFT]].to(dtype), sweep)
        norms[MEAN_U] = sums[S_U] / total
        ratio_minus_one = (sums[REF_MINUS_POLICY] / total).clamp_min(torch.finfo(dtype).eps - 1.0)
        out[2] = (norms[MEAN_U] + torch.log1p(ratio_minus_one)).clamp_min(0.0)
    if support is not None and threshold is not None:
        support[0] = total / (total + sums[DROPPED])
        support[1] = sums[SUPPORT_SIZE]
        support[2] = sums[TARGET_OUT]
    return out.to(dtype), norms.to(dtype)


def _mean_u_again(chunk: Rows, rows: torch.Tensor, row_norms, sweep: Sweep) -> torch.Tensor:
    """S E[u] of the chunk's ``rows`` over all ranks, each element's u formed as the backward forms it
    (``row_mean_u``)."""
    x, y, threshold, temperature = chunk.x, chunk.y, chunk.threshold, sweep.temperature
    dtype = row_norms.dtype
    found = torch.zeros(rows.numel(), dtype=dtype, device=x.device)
    if x.shape[1]:
        xk, yk = _kernel_input(x, dtype), _kernel_input(y, dtype)
        thr = threshold.to(dtype).contiguous() if threshold is not None else row_norms
        launches["mean_u"] += 1
        _kernels().row_mean_u[(rows.numel(),)](
            xk,
            yk,
            rows,
            row_norms.contiguous(),
            thr,
            found,
            xk.stride(0),
            yk.stride(0),
            row_norms.shape[1],
            x.shape[1],
            _inverse_temperature(temperature, dtype, x.device),
            TRUNCATED=threshold is not None,
            LOW=LOW[dtype],
            BLOCK=_block(x.shape[1]),
            **LAUNCH_OPTIONS,
        )
    return all_reduce(found.double(), dist.ReduceOp.SUM, sweep.group)


def backward(rows: Rows, norms, upstream: Upstream, sweep: Sweep, out):
    """``vocab_parallel.chunk_grad`` from the Triton kernel: dL/dx of this rank's valid columns [n, valid] into
    ``out`` (may be ``rows.x`` itself: each block is read before it is written); returns ``out``."""
    x, y, targets, threshold, shard = rows.x, rows.y, rows.targets, rows.threshold, sweep.shard
    g_lp, g_h, g_kl, temperature = upstream.logprob, upstream.entropy, upstream.kl, sweep.temperature
    n, cols = x.shape
    if not n or not cols:
        return out
    dtype = norms.dtype
    device = x.device
    xk = _kernel_input(x, dtype)
    yk = _kernel_input(y, dtype) if (y is not None and g_kl is not None) else xk
    target = torch.full((n,), -1, dtype=torch.int64, device=device)
    if targets is not None and g_lp is not None:
        local, owned = shard.owned(targets)
        target = torch.where(owned, local, target)
    grads = torch.zeros(3, n, dtype=dtype, device=device)
    for slot, grad in enumerate((g_lp, g_h, g_kl)):
        if grad is not None:
            grads[slot] = grad.to(dtype)
    destination = out
    writable = out.stride(-1) == 1 and not (_interpreting() and out.dtype not in (torch.float32, torch.float64))
    if not writable:
        destination = torch.empty(n, cols, dtype=dtype, device=device)
    thr = threshold.to(dtype).contiguous() if threshold is not None else norms
    launches["backward"] += 1
    _kernels().row_grad[(n,)](
        xk,
        yk,
        destination,
        norms.contiguous(),
        grads,
        target,
        thr,
        xk.stride(0),
        yk.stride(0),
        destination.stride(0),
        cols,
        _inverse_temperature(temperature, dtype, device),
        HAS_LP=g_lp is not None,
        HAS_H=g_h is not None,
        HAS_KL=g_kl is not None and y is not None,
        TRUNCATED=threshold is not None,
        LOW=LOW[dtype],
        BLOCK=_block(cols),
        **LAUNCH_OPTIONS,
    )
    if destination is not out:
        out.copy_(destination)
    return out
