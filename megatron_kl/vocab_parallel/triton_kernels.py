"""Triton kernels of the vocab-parallel statistics: one program per row, the row read once forward and once
backward (plus one write of the gradient).

Imported lazily by :mod:`megatron_kl.vocab_parallel.triton_stats` (Triton picks compiled or interpreted kernels when a
function is decorated, from ``TRITON_INTERPRET``). Kept to the language both Triton 3.6 (the GPU image) and
3.9 (CI's interpreter) accept: loads, stores, ``tl.max`` / ``tl.sum``, ``tl.where``, ``tl.exp``, a
``range`` loop over column blocks and ``tl.static_range``. No ``libdevice`` (the interpreter has none):
``_expm1`` is a Taylor polynomial below |v| = 1/2 and exp(v) - 1 above.

Forward (``row_partials``), per row of one rank's valid columns, in one pass with running maxima (online
softmax): with m / n the running maxima of x / y, zl = (x - m) / tau, el = exp(zl) (0 off the truncated
support), nu = ((y - x) + (m - n)) / tau (= -u relative to these maxima), the partials

    S = sum el      A = sum el zl      B = -sum el nu      C = sum el_full expm1(nu)
    D = sum el_full off the support    K = the support's size

are carried block to block. When the maxima move to m' / n' (delta = (m - m') / tau, gamma =
((m' - n') - (m - n)) / tau, alpha = exp(delta), beta = exp((n - n') / tau) = alpha exp(gamma)):

    S' = alpha S    A' = alpha (A + delta S)    B' = alpha (B - gamma S)    D' = alpha D
    C' = beta C + (alpha expm1(gamma)) (S + D)          [expm1(a + b) = e^b expm1(a) + expm1(b)]
    G' = G + |gamma|

so nothing is re-read. B carries the rounding of the shifts it went through: each element's u was formed
relative to the shift of its block's maxima, so E[u] is off by about eps |gamma| from the u that the backward
forms with the global shift, and where one token holds nearly all the mass the gradient's u_a - E[u] is that
rounding. G = sum |gamma| (with the ranks' own |gamma|: the drift) measures it; rows whose drift exceeds
DRIFT_LIMIT (unrelated logits of 1e4, say; never near the reference, where gamma = O(eps)) get E[u] once more
from ``row_mean_u``, a second read with the global M and M - M_r, the u of the backward exactly.
The same rescaling combines the ranks' partials (``triton_stats.combine``). Logits below -LOW (-inf included)
are read as -LOW (no inf - inf or 0 * inf anywhere; their mass is exp(-LOW) = 0); masked lanes get el = 0.

Backward (``row_grad``): with the row's global M, M - M_r, S, E[zc], E[u] (``vocab_parallel`` docstring):

    dL/dx_a = e_a / (S tau) * (-g_lp - g_H (zc_a - E[zc]) + g_KL (u_a - E[u]))  +  1[a = t] g_lp / tau
"""

from __future__ import annotations

import triton
import triton.language as tl

KL_DIRECT = tl.constexpr(60.0)  # as vocab_parallel.KL_DIRECT (a jit function reads only constexpr globals)


@triton.jit
def _expm1(v, TERMS: tl.constexpr):
    """expm1(v): Horner's form of the Taylor series to v^TERMS / TERMS! where |v| < 1/2, exp(v) - 1 elsewhere."""
    p = v * 0 + 1
    for k in tl.static_range(TERMS, 1, -1):
        p = 1 + p * (v / k)
    series = v * p
    return tl.where(tl.abs(v) < 0.5, series, tl.exp(tl.minimum(v, 80.0)) - 1)  # callers discard v > 80


@triton.jit
def _logits_block(row_ptr, start, valid, dtype: tl.constexpr, LOW: tl.constexpr, BLOCK: tl.constexpr):
    """Columns ``start .. start + BLOCK`` of one row: (column ids, in range, logits in ``dtype``, those below
    -LOW - -inf included - read as -LOW)."""
    cols = start + tl.arange(0, BLOCK)
    inside = cols < valid
    return cols, inside, tl.maximum(tl.load(row_ptr + cols, mask=inside, other=-LOW).to(dtype), -LOW)


@triton.jit
def row_partials(
    x_ptr,
    y_ptr,
    threshold_ptr,
    partial_ptr,
    x_stride,
    y_stride,
    valid,
    inv_tau_ptr,
    HAS_Y: tl.constexpr,
    ENTROPY: tl.constexpr,
    TRUNCATED: tl.constexpr,
    LOW: tl.constexpr,
    TERMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """partial [9, rows]: m, n, S, A, B, C, D, K, G of each row (module docstring); float32 or float64 math as
    the partial buffer's dtype."""
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0).to(tl.int64)
    dtype = partial_ptr.dtype.element_ty
    inv_tau = tl.load(inv_tau_ptr)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
    zero = tl.sum(tl.zeros([BLOCK], dtype), 0)
    m = zero - LOW
    n = zero - LOW
    s = zero
    a_sum = zero
    b_sum = zero
    c_sum = zero
    d_sum = zero
    k_sum = zero
    drift = zero
    threshold = zero - LOW
    if TRUNCATED:
        threshold = tl.load(threshold_ptr + row).to(dtype)
    for start in range(0, valid, BLOCK):
        cols, inside, x = _logits_block(x_row, start, valid, dtype, LOW, BLOCK)
        m_new = tl.maximum(m, tl.max(x, 0))
        delta = (m - m_new) * inv_tau
        alpha = tl.exp(delta)
        zl = (x - m_new) * inv_tau
        e_full = tl.where(inside, tl.exp(zl), 0.0)
        e = e_full
        if TRUNCATED:
            kept = inside & (x >= threshold)
            e = tl.where(kept, e_full, 0.0)
            k_sum += tl.sum(kept.to(dtype), 0)
        if HAS_Y:
            y = _logits_block(y_row, start, valid, dtype, LOW, BLOCK)[2]
            n_new = tl.maximum(n, tl.max(y, 0))
            gamma = ((m_new - n_new) - (m - n)) * inv_tau
            beta = tl.exp((n - n_new) * inv_tau)
            moved = tl.where(tl.abs(gamma) < 0.5, alpha * _expm1(gamma, TERMS), beta - alpha)  # alpha expm1(gamma)
            nu = ((y - x) + (m_new - n_new)) * inv_tau
            direct = tl.exp((y - n_new) * inv_tau)
            c_terms = tl.where(nu > KL_DIRECT, direct, e_full * _expm1(tl.minimum(nu, KL_DIRECT), TERMS))
            c_sum = beta * c_sum + moved * (s + d_sum) + tl.sum(tl.where(inside, c_terms, 0.0), 0)
            b_sum = alpha * (b_sum - gamma * s) - tl.sum(e * nu, 0)
            drift += tl.where(s > 0, tl.abs(gamma), 0.0)
            n = n_new
        if ENTROPY:
            a_sum = alpha * (a_sum + delta * s) + tl.sum(e * zl, 0)
        if TRUNCATED:
            d_sum = alpha * d_sum + tl.sum(e_full - e, 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    tl.store(partial_ptr + row, m)
    tl.store(partial_ptr + rows + row, n)
    tl.store(partial_ptr + 2 * rows + row, s)
    tl.store(partial_ptr + 3 * rows + row, a_sum)
    tl.store(partial_ptr + 4 * rows + row, b_sum)
    tl.store(partial_ptr + 5 * rows + row, c_sum)
    tl.store(partial_ptr + 6 * rows + row, d_sum)
    tl.store(partial_ptr + 7 * rows + row, k_sum)
    tl.store(partial_ptr + 8 * rows + row, drift)


@triton.jit
def row_grad(
    x_ptr,
    y_ptr,
    out_ptr,
    norms_ptr,
    upstream_ptr,
    target_ptr,
    threshold_ptr,
    x_stride,
    y_stride,
    out_stride,
    valid,
    inv_tau_ptr,
    HAS_LP: tl.constexpr,
    HAS_H: tl.constexpr,
    HAS_KL: tl.constexpr,
    TRUNCATED: tl.constexpr,
    LOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dL/dx of one row's valid columns into ``out`` (module docstring). ``norms [5, rows]``: M, M - M_r, S,
    E[zc], E[u]; ``upstream [3, rows]``: g_lp, g_H, g_KL (read where flagged); ``target [rows]``: the local
    column of the target (-1 where another rank owns it or there is none)."""
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0).to(tl.int64)
    dtype = norms_ptr.dtype.element_ty
    inv_tau = tl.load(inv_tau_ptr)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
    out_row = out_ptr + row * out_stride
    row_max = tl.load(norms_ptr + row)
    total = tl.load(norms_ptr + 2 * rows + row)
    scale = 1.0 / (total / inv_tau)  # pi = e / S; d/dx = d/dz / tau
    constant = tl.sum(tl.zeros([BLOCK], dtype), 0)
    g_lp = constant
    if HAS_LP:
        g_lp = tl.load(upstream_ptr + row)
        constant = -g_lp * scale
    neg_b = constant
    mean_zc = constant
    if HAS_H:
        neg_b = -tl.load(upstream_ptr + rows + row) * scale
        mean_zc = tl.load(norms_ptr + 3 * rows + row)
    k = constant
    shift = constant
    mean_u = constant
    if HAS_KL:
        k = tl.load(upstream_ptr + 2 * rows + row) * scale
        shift = tl.load(norms_ptr + rows + row)
        mean_u = tl.load(norms_ptr + 4 * rows + row)
    target = tl.load(target_ptr + row)
    threshold = constant - LOW
    if TRUNCATED:
        threshold = tl.load(threshold_ptr + row).to(dtype)
    for start in range(0, valid, BLOCK):
        cols, inside, x = _logits_block(x_row, start, valid, dtype, LOW, BLOCK)
        zc = (x - row_max) * inv_tau
        e = tl.exp(zc)
        if TRUNCATED:
            e = tl.where(x >= threshold, e, 0.0)
        bracket = constant + tl.zeros([BLOCK], dtype)
        if HAS_H:
            bracket += neg_b * (zc - mean_zc)
        if HAS_KL:
            y = _logits_block(y_row, start, valid, dtype, LOW, BLOCK)[2]
            bracket += k * (((x - y) - shift) * inv_tau - mean_u)
        grad = e * bracket
        if HAS_LP:
            grad += tl.where(cols == target, g_lp * inv_tau, 0.0)
        tl.store(out_row + cols, grad.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def row_mean_u(
    x_ptr,
    y_ptr,
    index_ptr,
    norms_ptr,
    threshold_ptr,
    out_ptr,
    x_stride,
    y_stride,
    norms_stride,
    valid,
    inv_tau_ptr,
    TRUNCATED: tl.constexpr,
    LOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[i] = sum_a e_a u_a over this rank's valid columns of row ``index[i]``, with e and u formed as
    ``row_grad`` forms them (``norms [2, norms_stride]``: M and M - M_r in the compute dtype)."""
    i = tl.program_id(0)
    row = tl.load(index_ptr + i)
    dtype = norms_ptr.dtype.element_ty
    inv_tau = tl.load(inv_tau_ptr)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
    row_max = tl.load(norms_ptr + row)
    shift = tl.load(norms_ptr + norms_stride + row)
    total = tl.sum(tl.zeros([BLOCK], dtype), 0)
    threshold = total - LOW
    if TRUNCATED:
        threshold = tl.load(threshold_ptr + row).to(dtype)
    for start in range(0, valid, BLOCK):
        cols, inside, x = _logits_block(x_row, start, valid, dtype, LOW, BLOCK)
        y = _logits_block(y_row, start, valid, dtype, LOW, BLOCK)[2]
        e = tl.where(inside, tl.exp((x - row_max) * inv_tau), 0.0)
        if TRUNCATED:
            e = tl.where(x >= threshold, e, 0.0)
        total += tl.sum(e * (((x - y) - shift) * inv_tau), 0)
    tl.store(out_ptr + i, total)
