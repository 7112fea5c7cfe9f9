"""Accuracy of the vocab-parallel kernels in the regimes RL runs hit, fp32 inputs against float64 on the
same values, at TP 1, 2 and 4 (gloo):

* exact KL where RL starts (reference = policy + eps * noise, KL ~ eps^2 / 2 per row): judged by relative
  error, for ``full_kl``, ``fused_stats``, ``fused_linear_stats`` and the fused single pass;
* log-probs and entropy, forward and backward, on logits 2*randn, 1e4 + 2*randn and 1e4*randn at
  temperatures 0.7 / 1 / 1.3: error at most twice that of naive fp32 autograd on the same inputs;
* verl's published tolerance for its vocab-parallel entropy / log-probs test (atol 1e-5 against the
  unsharded fp32 functions, V = 155136, TP = 2).
"""

import itertools

import pytest
import torch

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.testing.worlds import worlds
from megatron_kl.validation.accuracy_workers import (
    logits_inputs,
    logprob_entropy_worker,
    near_reference_inputs,
    near_reference_worker,
)

EPS_TOLERANCE = {1e-2: 1e-2, 1e-3: 1e-2, 1e-4: 5e-2}  # max relative error of the per-row KL
GRAD_TOLERANCE = 2e-2  # relative error (norm) of the KL gradient, eps >= 1e-3
APIS = ("full_kl", "fused_stats", "fused_linear", "fused_linear_single_pass")


def _near_reference_cases():
    cases = []
    for i, (api, eps) in enumerate(itertools.product(APIS, EPS_TOLERANCE)):
        cases.append(dict(seed=i, api=api, eps=eps, rows=24, vocab=2048, hidden=64, temperature=1.0, chunk=7))
    for i, api in enumerate(APIS):  # a temperature: u is formed from the raw logit differences
        cases.append(dict(seed=50 + i, api=api, eps=1e-3, rows=24, vocab=2048, hidden=64, temperature=0.7, chunk=5))
    return cases


def _float64_kl(case):
    data = near_reference_inputs(case)
    tau, weights = case["temperature"], data["weights"]
    if case["api"].startswith("fused_linear"):
        h = data["hidden"].double().requires_grad_(True)
        w = data["weight"].double().requires_grad_(True)
        logp = torch.log_softmax(h @ w.t() / tau, -1)
        logq = torch.log_softmax(h.detach() @ data["reference_weight"].double().t() / tau, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        grad_h, grad_w = torch.autograd.grad((weights * kl).sum(), (h, w))
        return kl.detach(), {"grad_hidden": grad_h, "grad_weight": grad_w}
    x = data["logits"].double().requires_grad_(True)
    logp = torch.log_softmax(x / tau, -1)
    logq = torch.log_softmax(data["reference"].double() / tau, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    (grad,) = torch.autograd.grad((weights * kl).sum(), x)
    return kl.detach(), {"grad": grad}


def _gathered(per_rank, index, key):
    dim = 0 if key == "grad_weight" else -1
    if key == "grad_hidden":  # replicated after the TP all-reduce
        return per_rank[0][index][key]
    return torch.cat([r[index][key] for r in per_rank], dim=dim)


@pytest.mark.parametrize("world", worlds([1, 2, 4]))
def test_exact_kl_near_the_reference_has_small_relative_error(world):
    cases = _near_reference_cases()
    per_rank = run_ranks(near_reference_worker, world, cases)
    for index, case in enumerate(cases):
        true_kl, true_grads = _float64_kl(case)
        for rank_results in per_rank:
            got = rank_results[index]["kl"]
            rel = ((got - true_kl).abs() / true_kl).max().item()
            print(
                f"TP={world} {case['api']} eps={case['eps']} tau={case['temperature']}: "
                f"KL {true_kl.mean():.2e}, max relative error {rel:.2e}"
            )
            assert rel <= EPS_TOLERANCE[case["eps"]], (case, rel)
            assert (got >= -1e-3 * true_kl).all(), case
        if case["eps"] >= 1e-3:
            for key, expected in true_grads.items():
                grad = _gathered(per_rank, index, key)
                rel = ((grad - expected).norm() / expected.norm()).item()
                print(f"  {key}: relative error {rel:.2e}")
                assert rel <= GRAD_TOLERANCE, (case, key, rel)


def _logprob_entropy_cases():
    cases = []
    for i, (kind, tau) in enumerate(itertools.product(("2randn", "1e4+2randn", "1e4randn"), (0.7, 1.0, 1.3))):
        cases.append(dict(seed=10 + i, kind=kind, temperature=tau, rows=16, vocab=4096, chunk=5))
    return cases


def _errors_of_naive_fp32(case):
    """(float64 truth, max abs errors of naive fp32 autograd) for log-probs, entropy and the gradient."""
    logits, targets, weights = logits_inputs(case)
    results = {}
    for dtype in (torch.float64, torch.float32):
        x = logits.to(dtype).requires_grad_(True)
        logp = torch.log_softmax(x / case["temperature"], -1)
        lp = logp.gather(-1, targets[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        (grad,) = torch.autograd.grad((weights[0].to(dtype) * lp + weights[1].to(dtype) * ent).sum(), x)
        results[dtype] = {"logprobs": lp.detach().double(), "entropy": ent.detach().double(), "grad": grad.double()}
    truth = results[torch.float64]
    naive = {k: (results[torch.float32][k] - truth[k]).abs().max().item() for k in truth}
    return truth, naive


@pytest.mark.parametrize("world", worlds([1, 2, 4]))
def test_logprobs_and_entropy_at_most_twice_naive_fp32_error(world):
    cases = _logprob_entropy_cases()
    per_rank = run_ranks(logprob_entropy_worker, world, cases)
    for index, case in enumerate(cases):
        truth, naive = _errors_of_naive_fp32(case)
        for key in ("logprobs", "entropy", "grad"):
            got = _gathered(per_rank, index, key) if key == "grad" else per_rank[0][index][key]
            err = (got.double() - truth[key]).abs().max().item()
            floor = 4 * torch.finfo(torch.float32).tiny  # both exact (e.g. one-hot rows): nothing to compare
            print(
                f"TP={world} {case['kind']} tau={case['temperature']} {key}: ours {err:.2e}, naive fp32 {naive[key]:.2e}"
            )
            assert err <= 2 * naive[key] + floor, (case, key, err, naive[key])


def test_verl_published_tolerance_at_v155136_tp2():
    """verl tests its vocab-parallel entropy and log-probs (and their gradients) against the unsharded fp32
    functions at atol 1e-5 with V = 155136; ours at TP=2 against the same fp32 functions."""
    case = dict(seed=7, kind="2randn", temperature=1.0, rows=256, vocab=155136)
    per_rank = run_ranks(logprob_entropy_worker, 2, [case])
    logits, targets, weights = logits_inputs(case)
    x = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(x, -1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    (grad,) = torch.autograd.grad((weights[0] * lp + weights[1] * ent).sum(), x)
    torch.testing.assert_close(per_rank[0][0]["logprobs"], lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_rank[0][0]["entropy"], ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(_gathered(per_rank, 0, "grad"), grad, atol=1e-5, rtol=0)
