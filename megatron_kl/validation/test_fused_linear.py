"""Fused linear vocab-parallel log-prob / entropy / exact KL (output projection inside the chunk loop) on
1, 2 and 4 gloo ranks: values and gradients w.r.t. the hidden states and the weight shard against a float64
full-vocabulary reference and against the unfused path (materialised logits + vocab_parallel)."""

import itertools

import pytest
import torch

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.testing.worlds import worlds
from megatron_kl.validation.fused_linear_workers import fused_linear_worker, make_case, single_pass_worker
from megatron_kl.vocab_parallel.fused_linear import fused_linear_stats

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}


def _cases():
    cases = []
    grid = itertools.product(("float64", "float32"), (1.0, 0.7), (3, 5, 64), ((29, 32), (32, 32)), (False, True))
    for i, (dtype, temperature, chunk, (vocab, padded), use_mask) in enumerate(grid):
        cases.append(
            dict(
                seed=i,
                seq=8,
                batch=2,
                hidden=12,
                vocab=vocab,
                padded_vocab=padded,
                dtype=dtype,
                temperature=temperature,
                chunk=chunk,
                scale=3.0,
                use_mask=use_mask,
                sequence_parallel=i % 3 == 0,
            )
        )
    for dtype in ("float64", "float32"):  # extreme logits (|z| ~ 1e4)
        cases.append(
            dict(
                seed=100,
                seq=4,
                batch=2,
                hidden=8,
                vocab=30,
                padded_vocab=32,
                dtype=dtype,
                temperature=0.9,
                chunk=3,
                scale=3e3,
                use_mask=True,
            )
        )
    cases.append(
        dict(
            seed=200,
            seq=6,
            batch=2,
            hidden=16,
            vocab=31,
            padded_vocab=32,
            dtype="bfloat16",
            temperature=0.8,
            chunk=5,
            scale=2.0,
            use_mask=False,
        )
    )
    return cases


def _reference(case):
    full = make_case(case)
    dtype = getattr(torch, case["dtype"])
    h = full["hidden"].to(dtype).double().requires_grad_(True)  # the ranks' input rounding
    w = full["weight"].to(dtype).double().requires_grad_(True)
    v, tau = case["vocab"], case["temperature"]
    logp = torch.log_softmax((h @ w.t())[..., :v] / tau, -1)
    logq = torch.log_softmax(
        (full["reference_hidden"].to(dtype).double() @ full["reference_weight"].to(dtype).double().t())[..., :v] / tau,
        -1,
    )
    p = logp.exp()
    values = {
        "logprobs": logp.gather(-1, full["targets"][..., None])[..., 0],
        "entropy": -(p * logp).sum(-1),
        "kl": (p * (logp - logq)).sum(-1),
    }
    m = full["mask"].double()
    loss = (
        (
            full["weights"][0] * values["logprobs"]
            + full["weights"][1] * values["entropy"]
            + full["weights"][2] * values["kl"]
        )
        * m
    ).sum()
    grad_hidden, grad_weight = torch.autograd.grad(loss, (h, w))
    return {k: v.detach() for k, v in values.items()}, grad_hidden, grad_weight, full["mask"]


def _rel(got, expected, floor=1.0):
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


@pytest.mark.parametrize("world", worlds([1, 2, 4]))
def test_fused_linear_matches_float64_and_unfused(world):
    cases = _cases()
    per_rank = run_ranks(fused_linear_worker, world, cases)
    for index, case in enumerate(cases):
        expected, grad_hidden, grad_weight, mask = _reference(case)
        tol = TOL[case["dtype"]]
        sp = case.get("sequence_parallel", False) and world > 1
        for rank, results in enumerate(per_rank):
            got = results[index]
            for key in ("logprobs", "entropy", "kl"):
                err = _rel(got[key][mask], expected[key][mask])
                assert err <= tol, f"world={world} {case} {key}: {err:.2e}"
                if case.get("use_mask"):
                    assert (got[key][~mask] == 0).all(), "masked rows must output 0"
            for key in ("entropy", "kl"):
                assert _rel(got[key][mask], got[f"unfused_{key}"][mask]) <= tol, f"{case} {key} vs unfused"
            expected_h = grad_hidden.chunk(world, dim=0)[rank] if sp else grad_hidden
            err = _rel(got["grad_hidden"], expected_h, 1e-3)
            assert err <= tol, f"world={world} {case} grad_hidden: {err:.2e}"
            unfused_h = got["unfused_grad_hidden"].chunk(world, dim=0)[rank] if sp else got["unfused_grad_hidden"]
            assert _rel(got["grad_hidden"], unfused_h, 1e-3) <= tol, f"{case} grad_hidden vs unfused"
            assert _rel(got["grad_weight"], got["unfused_grad_weight"], 1e-3) <= tol, f"{case} grad_weight vs unfused"
            assert all(torch.isfinite(v).all() for v in got.values()), case
        grad_w = torch.cat([results[index]["grad_weight"] for results in per_rank], dim=0)
        err = _rel(grad_w, grad_weight, 1e-3)
        assert err <= tol, f"world={world} {case} grad_weight: {err:.2e}"
        assert (grad_w[case["vocab"] :] == 0).all(), "padded vocabulary rows of the weight must get no gradient"


def test_fixed_chunk_is_deterministic_and_chunks_agree():
    case = dict(
        seed=7,
        seq=16,
        batch=3,
        hidden=24,
        vocab=50,
        padded_vocab=64,
        dtype="float32",
        temperature=0.8,
        chunk=0,
        scale=3.0,
    )
    full = make_case(case)

    def run(chunk):
        h = full["hidden"].float().requires_grad_(True)
        w = full["weight"].float().requires_grad_(True)
        s = fused_linear_stats(
            h,
            w,
            None,
            targets=full["targets"],
            reference_hidden=full["reference_hidden"].float(),
            reference_weight=full["reference_weight"].float(),
            temperature=0.8,
            vocab_size=50,
            chunk_size=chunk,
        )
        grads = torch.autograd.grad((s.logprobs + s.entropy + s.kl).sum(), (h, w))
        return torch.cat([s.logprobs, s.entropy, s.kl]).flatten(), grads

    first, again = run(7), run(7)
    assert torch.equal(first[0], again[0]) and all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
    other = run(48)
    assert _rel(other[0], first[0]) < 1e-5 and all(_rel(a, b, 1e-3) < 1e-5 for a, b in zip(other[1], first[1]))


def test_bad_shapes_name_the_argument():
    h, w = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="weight shape"):
        fused_linear_stats(h, torch.randn(16, 7), None)
    with pytest.raises(ValueError, match="reference_hidden and reference_weight"):
        fused_linear_stats(h, w, None, reference_hidden=h)
    with pytest.raises(ValueError, match="targets shape"):
        fused_linear_stats(h, w, None, targets=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_stats(h, w, None, temperature=0.0)


@pytest.mark.parametrize("world", worlds([1, 2]))
def test_single_pass_gradients_equal_autograd(world):
    """model.fused_grad=in_forward's kernel: the same statistics and gradients as back-propagating through
    fused_linear_stats, for a row-separable nonlinear loss, with one probe per chunk."""
    cases = [
        dict(
            seed=3,
            seq=9,
            batch=2,
            hidden=16,
            vocab=29,
            padded_vocab=32,
            dtype="float64",
            temperature=0.7,
            chunk=5,
            scale=3.0,
        ),
        dict(
            seed=4,
            seq=12,
            batch=3,
            hidden=24,
            vocab=64,
            padded_vocab=64,
            dtype="float32",
            temperature=1.0,
            chunk=64,
            scale=2.0,
        ),
        # bf16: dL/dh and each chunk's dL/dW as bf16 GEMMs, dL/dW summed over 3 chunks in float32
        dict(
            seed=5,
            seq=10,
            batch=2,
            hidden=16,
            vocab=31,
            padded_vocab=32,
            dtype="bfloat16",
            temperature=1.0,
            chunk=7,
            scale=2.0,
        ),
    ]
    per_rank = run_ranks(single_pass_worker, world, cases)
    for index, case in enumerate(cases):
        tol = TOL[case["dtype"]]
        for results in per_rank:
            got = results[index]
            assert got["probes"] == -(-case["seq"] * case["batch"] // case["chunk"])
            assert _rel(got["single_stats"], got["stats"]) <= tol
            assert _rel(got["single_grad_hidden"], got["grad_hidden"], 1e-3) <= tol, (world, case, "hidden")
            assert _rel(got["single_grad_weight"], got["grad_weight"], 1e-3) <= tol, (world, case, "weight")
