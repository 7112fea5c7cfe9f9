"""Vocab-parallel log-prob / entropy / exact KL, fused and unfused, forward and backward, on 1, 2 and 4
ranks against an unsharded float64 log_softmax reference."""

import itertools

import pytest
import torch

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.testing.worlds import worlds
from megatron_kl.validation.vocab_workers import make_case, vocab_parallel_worker

TOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2e-2}


def _cases():
    cases = []
    for i, (dtype, temperature, fused, (vocab, padded), scale) in enumerate(
        itertools.product(("float64", "float32"), (1.0, 0.7), (True, False), ((29, 32), (32, 32)), (3.0,))
    ):
        cases.append(
            dict(
                seed=i,
                batch=2,
                seq=5,
                vocab=vocab,
                padded_vocab=padded,
                dtype=dtype,
                temperature=temperature,
                fused=fused,
                chunk=3,
                scale=scale,
                inplace=fused and i % 2 == 1,
            )
        )
    # extreme logits (|z| up to 1e4): finite values and gradients
    for dtype in ("float64", "float32"):
        cases.append(
            dict(
                seed=100,
                batch=2,
                seq=4,
                vocab=30,
                padded_vocab=32,
                dtype=dtype,
                temperature=0.9,
                fused=True,
                chunk=4,
                scale=1e4 / 4,
            )
        )
    cases.append(
        dict(
            seed=200,
            batch=2,
            seq=6,
            vocab=31,
            padded_vocab=32,
            dtype="bfloat16",
            temperature=0.8,
            fused=True,
            chunk=5,
            scale=2.0,
        )
    )
    return cases


def _reference(case):
    logits, reference, targets, weights, mask = make_case(case)
    dtype = getattr(torch, case["dtype"])
    x = logits.to(dtype).double().requires_grad_(True)  # same rounding of the inputs as the ranks see
    r = reference.to(dtype).double()
    v, tau = case["vocab"], case["temperature"]
    logp = torch.log_softmax(x[..., :v] / tau, -1)
    logq = torch.log_softmax(r[..., :v] / tau, -1)
    p = logp.exp()
    lp = logp.gather(-1, targets.clamp(0, v - 1)[..., None])[..., 0]
    lp = torch.where(targets >= 0, lp, torch.zeros_like(lp))
    ent = -(p * logp).sum(-1)
    kl = (p * (logp - logq)).sum(-1)
    m = mask.double()
    loss = ((weights[0] * lp + weights[1] * ent + weights[2] * kl) * m).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return {"logprobs": lp.detach(), "entropy": ent.detach(), "kl": kl.detach(), "grad": grad}, mask


@pytest.mark.parametrize("world", worlds([1, 2, 4]))
def test_matches_unsharded_float64_reference(world):
    cases = _cases()
    per_rank = run_ranks(vocab_parallel_worker, world, cases)
    for index, case in enumerate(cases):
        expected, mask = _reference(case)
        tol = TOL[case["dtype"]]
        for rank_results in per_rank:  # outputs are identical on every rank
            got = rank_results[index]
            for key in ("entropy", "kl"):
                scale = expected[key].abs().max().clamp_min(1.0)
                err = ((got[key] - expected[key]).abs().max() / scale).item()
                assert err <= tol, f"{case} {key}: {err:.2e}"
            lp_err = ((got["logprobs"] - expected["logprobs"]) * mask).abs().max()
            assert (lp_err / expected["logprobs"].abs().max().clamp_min(1.0)).item() <= tol, f"{case} logprobs"
            assert all(torch.isfinite(got[k]).all() for k in got), case
        grad = torch.cat([r[index]["grad"] for r in per_rank], dim=-1)
        scale = expected["grad"].abs().max().clamp_min(1e-3)
        err = ((grad - expected["grad"]).abs().max() / scale).item()
        assert err <= tol, f"{case} grad: {err:.2e}"
        assert (grad[..., case["vocab"] :] == 0).all(), "padded vocabulary entries must get no gradient"
