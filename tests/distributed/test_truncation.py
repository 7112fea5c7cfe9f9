"""Top-k / top-p truncation over a TP-sharded vocabulary: the support found over 1, 2 and 4 ranks equals a
direct single-process computation of the rule token for token (ties, a cut on a shard boundary, logits of
1e4, vocabulary padding), and the truncated distribution's log-probs, entropy, KL(mu || pi_ref) and
gradients (logits; hidden and weight on the fused-linear path) match float64 autograd of the renormalised
formula."""

import itertools

import pytest
import torch

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.testing.worlds import worlds
from tests.distributed.truncation_workers import make_case, truncation_worker

TOL = {"float64": 1e-10, "float32": 2e-5}


def direct_support(values: torch.Tensor, top_k: int, top_p: float, tau: float) -> torch.Tensor:
    """The rule written out per row with a full sort: keep logits >= the k-th largest; then, in descending
    order, positions whose preceding top-k mass is < top_p, and every logit >= the last of them."""
    keep = torch.ones_like(values, dtype=torch.bool)
    for i, row in enumerate(values):
        ordered = row.sort(descending=True).values
        if 0 < top_k < len(row):
            keep[i] &= row >= ordered[top_k - 1]
        if top_p < 1.0:
            probs = torch.where(keep[i], torch.exp((row - row.max()) / tau), torch.zeros_like(row))
            probs = probs / probs.sum()
            order = torch.argsort(row, descending=True, stable=True)
            p_sorted = probs[order]
            inside = keep[i][order] & ((p_sorted.cumsum(0) - p_sorted) < top_p)
            keep[i] &= row >= row[order][inside].min()
    return keep


def _cases():
    cases = []
    grid = itertools.product(("float64", "float32"), ((10, 1.0), (0, 0.9), (25, 0.7)), (1.0, 0.7))
    for i, (dtype, (top_k, top_p), tau) in enumerate(grid):
        cases.append(
            dict(
                seed=i,
                rows=7,
                vocab=61,
                padded_vocab=64,
                dtype=dtype,
                top_k=top_k,
                top_p=top_p,
                temperature=tau,
                chunk=3,
                scale=3.0,
            )
        )
    cases += [
        dict(
            seed=50,
            rows=6,
            vocab=64,
            padded_vocab=64,
            dtype="float64",
            top_k=9,
            top_p=0.8,
            temperature=1.0,
            chunk=4,
            scale=1.0,
            kind="ties",
        ),
        dict(
            seed=51,
            rows=6,
            vocab=64,
            padded_vocab=64,
            dtype="float32",
            top_k=0,
            top_p=0.6,
            temperature=0.9,
            chunk=4,
            scale=1.0,
            kind="ties",
        ),
        # the support is exactly the first half of the vocabulary: the cut falls between shards at TP 2 and 4
        dict(
            seed=52,
            rows=4,
            vocab=64,
            padded_vocab=64,
            dtype="float64",
            top_k=32,
            top_p=1.0,
            temperature=1.0,
            chunk=4,
            scale=30.0,
            kind="shard_boundary",
        ),
        dict(
            seed=53,
            rows=4,
            vocab=64,
            padded_vocab=64,
            dtype="float64",
            top_k=0,
            top_p=0.999,
            temperature=1.0,
            chunk=4,
            scale=30.0,
            kind="shard_boundary",
        ),
        dict(
            seed=54,
            rows=5,
            vocab=60,
            padded_vocab=64,
            dtype="float32",
            top_k=12,
            top_p=0.95,
            temperature=0.8,
            chunk=2,
            scale=1e4 / 4,
        ),  # logits ~1e4
        dict(
            seed=55,
            rows=300,
            vocab=2000,
            padded_vocab=2000,
            dtype="float32",
            top_k=0,
            top_p=0.999,
            temperature=1.0,
            chunk=128,
            scale=0.3,
        ),  # supports of ~1000 tokens: the candidate retries
        # vocabulary 20 padded to 64: at TP 4 two ranks hold padding only (no columns)
        dict(
            seed=58,
            rows=5,
            vocab=20,
            padded_vocab=64,
            dtype="float64",
            top_k=0,
            top_p=0.8,
            temperature=1.0,
            chunk=2,
            scale=0.2,
        ),
        dict(
            seed=56,
            rows=9,
            vocab=61,
            padded_vocab=64,
            dtype="float64",
            top_k=20,
            top_p=0.85,
            temperature=0.7,
            chunk=4,
            scale=2.0,
            kind="linear",
        ),
        dict(
            seed=57,
            rows=9,
            vocab=64,
            padded_vocab=64,
            dtype="float32",
            top_k=0,
            top_p=0.9,
            temperature=1.0,
            chunk=5,
            scale=2.0,
            kind="linear",
        ),
    ]
    for case in cases:
        logits, _, _, _ = make_case(case)
        x = logits.to(getattr(torch, case["dtype"])).double()[:, : case["vocab"]]
        keep = direct_support(x, case["top_k"], case["top_p"], case["temperature"])
        g = torch.Generator().manual_seed(case["seed"] + 1000)
        targets = [int(row.nonzero()[torch.randint(0, int(row.sum()), (1,), generator=g)]) for row in keep]
        outside = (~keep[0]).nonzero()
        if len(outside):  # row 0's target outside the support: the extended log-prob, flagged
            targets[0] = int(outside[0])
        case["targets"] = targets
    return cases


def _expected(case):
    logits, reference, weights, extra = make_case(case)
    dtype = getattr(torch, case["dtype"])
    vocab, tau = case["vocab"], case["temperature"]
    linear = case.get("kind") == "linear"
    if linear:
        hidden = extra["hidden"].to(dtype).double().requires_grad_(True)
        weight = extra["weight"].to(dtype).double().requires_grad_(True)
        x = hidden @ weight.T
        r = extra["ref_hidden"].to(dtype).double() @ extra["ref_weight"].to(dtype).double().T
        inputs = (hidden, weight)
    else:
        x = logits.to(dtype).double().requires_grad_(True)
        r = reference.to(dtype).double()
        inputs = (x,)
    keep = direct_support(x.detach()[:, :vocab], case["top_k"], case["top_p"], tau)
    z = x[:, :vocab] / tau
    masked = z.masked_fill(~keep, float("-inf"))
    log_norm = torch.logsumexp(masked, -1)
    logmu = z - log_norm[:, None]  # extended outside the support
    mu = torch.where(keep, logmu.exp(), torch.zeros_like(z))
    logq = torch.log_softmax(r[:, :vocab] / tau, -1)
    targets = torch.as_tensor(case["targets"])
    lp = logmu.gather(-1, targets[:, None])[:, 0]
    ent = -(mu * torch.where(keep, logmu, torch.zeros_like(z))).sum(-1)
    kl = (mu * torch.where(keep, logmu - logq, torch.zeros_like(z))).sum(-1)
    loss = (weights[0] * lp + weights[1] * ent + weights[2] * kl).sum()
    grads = torch.autograd.grad(loss, inputs)
    full = torch.softmax(z.detach(), -1)
    return dict(
        support=keep,
        logprobs=lp.detach(),
        entropy=ent.detach(),
        kl=kl.detach(),
        kept_mass=(full * keep).sum(-1),
        support_size=keep.sum(-1).double(),
        outside=(~keep.gather(-1, targets[:, None])[:, 0]).double(),
        grads=grads,
    )


def _relative(got, expected, floor=1.0):
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(floor))


@pytest.mark.parametrize("world", worlds([1, 2, 4]))
def test_sharded_support_and_truncated_statistics_match_the_direct_rule(world):
    cases = _cases()
    _check(cases, run_ranks(truncation_worker, world, cases))


@pytest.mark.parametrize("world", worlds([1, 2, 4]))
def test_the_bisection_by_sorted_rows_matches_the_direct_rule(world):
    """The GPU's bisection (rows sorted once, float64 suffix masses, a binary search a step) on every top-p-alone
    case, float32 too (no histograms), on CPU tensors: the same supports and statistics as the rule."""
    cases = [dict(case, lookup="sorted", histogram=False) for case in _cases() if case["top_k"] == 0]
    assert len(cases) >= 4 and {case["dtype"] for case in cases} == {"float32", "float64"}
    _check(cases, run_ranks(truncation_worker, world, cases))


def _check(cases, per_rank):
    for index, case in enumerate(cases):
        expected = _expected(case)
        tol = TOL[case["dtype"]]
        support = torch.cat([r[index]["support"] for r in per_rank], dim=-1)
        assert torch.equal(support, expected["support"]), f"{case}: support differs from the direct rule"
        assert bool((expected["support_size"] < case["vocab"]).any()), f"{case}: nothing was truncated"
        for rank_results in per_rank:
            got = rank_results[index]
            assert torch.equal(got["support_size"], expected["support_size"]), case
            assert torch.equal(got["outside"], expected["outside"]), case
            for key in ("logprobs", "entropy", "kl", "kept_mass"):
                err = _relative(got[key], expected[key])
                assert err <= tol, f"{case} {key}: {err:.2e}"
        if case.get("kind") == "linear":  # dL/dh: all-reduced over TP by the output layer's backward collective
            grad_hidden = per_rank[0][index]["grads"][0]
            assert all(torch.equal(r[index]["grads"][0], grad_hidden) for r in per_rank), case
            grad_weight = torch.cat([r[index]["grads"][1] for r in per_rank], dim=0)
            got_grads = (grad_hidden, grad_weight)
        else:
            got_grads = (torch.cat([r[index]["grads"][0] for r in per_rank], dim=-1),)
        for got, want in zip(got_grads, expected["grads"]):
            want = (
                torch.nn.functional.pad(want, (0, got.shape[-1] - want.shape[-1])) if got.shape != want.shape else want
            )
            err = _relative(got, want, floor=1e-3)
            assert err <= tol, f"{case} grad: {err:.2e}"
        assert float(expected["outside"][0]) == 1.0 or bool(expected["support"][0].all()), case


def test_no_truncation_is_the_full_distribution():
    from megatron_kl.vocab_parallel.stats import fused_stats
    from megatron_kl.vocab_parallel.truncation import Truncation

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=g, dtype=torch.float64)
    t = torch.randint(0, 40, (5,), generator=g)
    full = fused_stats(x, None, targets=t, temperature=0.8)
    for rule in (Truncation(0, 1.0), Truncation(40, 1.0), Truncation(100, 1.0)):
        same = fused_stats(x, None, targets=t, temperature=0.8, truncation=rule)
        assert torch.equal(same.logprobs, full.logprobs) and same.kept_mass is None


def test_candidate_blocks_do_not_change_the_support(monkeypatch):
    """The retries run on row blocks bounded by CANDIDATE_ELEMENTS; tiny blocks give the same thresholds."""
    import megatron_kl.vocab_parallel.truncation as truncation

    g = torch.Generator().manual_seed(3)
    x = 0.5 * torch.randn(300, 2000, generator=g, dtype=torch.float64)  # supports of hundreds: retries
    rules = (truncation.Truncation(40, 0.9), truncation.Truncation(0, 0.95), truncation.Truncation(0, 0.5))
    expected = [truncation.support_threshold(x, None, rule) for rule in rules]
    monkeypatch.setattr(truncation, "CANDIDATE_ELEMENTS", 1000)
    for rule, want in zip(rules, expected):
        assert torch.equal(truncation.support_threshold(x, None, rule), want), rule
        assert torch.equal(x >= want[:, None], direct_support(x, rule.top_k, rule.top_p, 1.0))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_block_maxima_selection_is_the_exact_top_m(dtype):
    """``_local_top`` picks its candidates from block maxima on wide rows: equal to torch.topk's values on
    random rows, on rows of heavy ties, on column slices (as a padded shard is) whose row stride the block
    width divides or not, with a ragged last block, and for m from 1 to where it selects directly."""
    from megatron_kl.vocab_parallel.truncation import _local_top

    g = torch.Generator().manual_seed(11)
    wide = torch.randn(33, 6000, generator=g, dtype=dtype)
    ties = torch.randint(0, 7, (33, 6000), generator=g).to(dtype)
    for x in (wide, ties, wide[:, :5000], ties[:, 64:5184], wide[:, :4999]):
        for m in (1, 3, 8, 21, 64, 200):
            want = torch.topk(x, m, dim=-1).values
            assert torch.equal(_local_top(x, m), want), (x.shape, x.stride(), m)


@pytest.mark.parametrize("lookup", ("pass", "sorted"))
@pytest.mark.parametrize("rule", ((20, 0.9), (5, 0.5), (0, 0.9), (0, 0.3)))
def test_wide_vocabulary_supports_equal_the_direct_rule(rule, lookup, monkeypatch):
    """Thresholds on a vocabulary wide enough for the block-maxima candidates and the top-k fast path: equal to
    the rule written out, on logits whose k-th value ties far beyond k (integer logits; the fast path must
    not take a normaliser from the candidates then), on peaked and on flat rows (the bisection)."""
    from megatron_kl.vocab_parallel import truncation
    from megatron_kl.vocab_parallel.truncation import Truncation, support_threshold

    monkeypatch.setattr(truncation, "BISECTION_LOOKUP", lookup)
    top_k, top_p = rule
    g = torch.Generator().manual_seed(12)
    tied = torch.randint(0, 4, (24, 4096), generator=g).double()
    tied[:, :3] += 4.0  # three clear leaders, then ties in the thousands
    for x in (
        tied,
        6.0 * torch.randn(24, 4096, generator=g, dtype=torch.float64),
        0.5 * torch.randn(24, 4096, generator=g, dtype=torch.float64),
    ):
        threshold = support_threshold(x, None, Truncation(top_k, top_p), 0.8)
        assert torch.equal(x >= threshold[:, None], direct_support(x, top_k, top_p, 0.8)), rule
