"""The Triton kernels of the vocab-parallel statistics, run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, ``MEGATRON_KL_TRITON=1``) at TP 1 and 2 (gloo ranks): the same float64-reference tests
the CPU kernels pass (log-probs, entropy, exact KL, fused and unfused, padded vocabularies, bf16 inputs upcast,
logits ~1e4, the exact KL near the reference judged by relative error, top-k / top-p supports with ties and a cut
on a shard boundary, the fused-linear path and its single pass), each rank asserting that the Triton kernels
computed it; then the edges (-inf entries, all-masked rows, one row, no rows, a rank holding padding only, rows
spanning many blocks and ending mid-block) against closed-form float64 gradients."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kl.testing import distributed
from megatron_kl.testing.worlds import worlds
from megatron_kl.validation import test_fused_linear, test_vocab_parallel, test_vocab_parallel_accuracy
from megatron_kl.vocab_parallel import triton_stats
from tests.distributed import test_truncation
from tests.distributed.triton_workers import edge_inputs, edge_worker, launch_worker, through_triton

pytest.importorskip("triton")


@pytest.fixture
def interpreter(monkeypatch):
    """The Triton path for every rank: compiled kernels on CUDA tensors where a GPU is there (one rank:
    MEGATRON_KL_TEST_WORLDS=1), the interpreter on CPU tensors elsewhere."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(triton_stats.ENV, "1")


def _checked_run_ranks(fn, world, *args, **kwargs):
    """``run_ranks`` whose ranks report their Triton launches: every rank must have launched the kernels."""
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        pytest.skip(
            f"{world} ranks on this machine are gloo ranks on the CPU: the interpreter runs them where no "
            "GPU is (MEGATRON_KL_TEST_WORLDS=1 on a one-GPU machine)"
        )
    wrapped = functools.partial(through_triton, fn)
    wrapped.__name__ = fn.__name__
    reports = distributed.run_ranks(wrapped, world, *args, **kwargs)
    for rank, report in enumerate(reports):
        assert report["enabled"], f"rank {rank}: the Triton path was not enabled"
        assert report["launches"]["forward"] > 0, f"rank {rank} of {fn.__name__}: no Triton forward kernel ran"
    return [report["result"] for report in reports]


@pytest.fixture
def checked(monkeypatch, interpreter):
    for module in (test_vocab_parallel, test_vocab_parallel_accuracy, test_truncation, test_fused_linear):
        monkeypatch.setattr(module, "run_ranks", _checked_run_ranks)


SUITES = {  # the float64-reference suites of the CPU kernels, run here on the Triton path
    "fused_and_unfused_statistics": (test_vocab_parallel, "test_matches_unsharded_float64_reference"),
    "exact_kl_near_the_reference": (
        test_vocab_parallel_accuracy,
        "test_exact_kl_near_the_reference_has_small_relative_error",
    ),
    "logprobs_and_entropy_at_logits_of_1e4": (
        test_vocab_parallel_accuracy,
        "test_logprobs_and_entropy_at_most_twice_naive_fp32_error",
    ),
    "truncated_statistics": (test_truncation, "test_sharded_support_and_truncated_statistics_match_the_direct_rule"),
    "fused_linear_single_pass": (test_fused_linear, "test_single_pass_gradients_equal_autograd"),
}


@pytest.mark.parametrize("world", worlds([1, 2]))
@pytest.mark.parametrize("suite", list(SUITES))
def test_the_cpu_kernels_float64_suites_pass_on_the_triton_path(suite, world, checked):
    module, name = SUITES[suite]
    getattr(module, name)(world)


def _edge_cases():
    base = dict(vocab=61, padded_vocab=64, temperature=0.8, scale=3.0, gap=0.5)
    return [
        dict(base, seed=1, rows=5, dtype="float64", masked_tokens=True),
        dict(base, seed=2, rows=5, dtype="float32", masked_tokens=True),
        dict(base, seed=3, rows=3, dtype="float32", all_masked=True),
        dict(base, seed=4, rows=1, dtype="float64"),
        dict(base, seed=5, rows=0, dtype="float32"),
        dict(base, seed=6, rows=4, dtype="float32", scale=2500.0, gap=1.0, temperature=1.3),  # logits ~1e4
        dict(base, seed=7, rows=4, dtype="float64", vocab=30),  # at TP 2 rank 1 holds padding only
        dict(base, seed=8, rows=6, dtype="float32", gap=1e-4, temperature=1.0),  # KL ~1e-9
    ]


def _closed_form(case):
    """log-probs, entropy, KL and dL/dx in float64 from log_softmax and the gradient formulas, with 0 log 0 = 0."""
    logits, reference, targets, weights = edge_inputs(case)
    dtype = getattr(torch, case["dtype"])
    v, tau = case["vocab"], case["temperature"]
    logp = torch.log_softmax(logits.to(dtype).double()[:, :v] / tau, -1)
    logq = torch.log_softmax(reference.to(dtype).double()[:, :v] / tau, -1)
    p = logp.exp()
    live = p > 0
    valid_target = targets >= 0
    lp = torch.where(
        valid_target, logp.gather(1, targets.clamp_min(0)[:, None])[:, 0], torch.zeros(len(targets)).double()
    )
    entropy = -torch.where(live, p * logp, torch.zeros_like(p)).sum(-1)
    diff = torch.where(live, logp - logq, torch.zeros_like(p))
    kl = (p * diff).sum(-1)
    onehot = torch.zeros_like(p).scatter_(1, targets.clamp_min(0)[:, None], 1.0) * valid_target[:, None]
    g_lp = (onehot - p * valid_target[:, None]) / tau
    g_h = -p * (torch.where(live, logp, torch.zeros_like(p)) + entropy[:, None]) / tau
    g_kl = p * (diff - kl[:, None]) / tau
    grad = torch.zeros_like(logits)
    grad[:, :v] = weights[0][:, None] * g_lp + weights[1][:, None] * g_h + weights[2][:, None] * g_kl
    return {"logprobs": lp, "entropy": entropy, "kl": kl, "grad": grad}


@pytest.mark.parametrize("world", worlds([1, 2]))
def test_edges_match_the_closed_form(world, interpreter, monkeypatch):
    monkeypatch.setenv(triton_stats.BLOCK_ENV, "16")  # 61 columns: four blocks, the last one partial
    cases = _edge_cases()
    per_rank = _checked_run_ranks(edge_worker, world, cases)
    for index, case in enumerate(cases):
        expected = _closed_form(case)
        tol = 1e-10 if case["dtype"] == "float64" else 2e-5
        for key in ("logprobs", "entropy", "kl", "grad"):
            got = torch.cat([r[index][key] for r in per_rank], -1) if key == "grad" else per_rank[0][index][key]
            assert torch.isfinite(got).all(), (case, key)
            error = (got - expected[key]).abs()
            if key == "logprobs":
                error = error * (edge_inputs(case)[2] >= 0)
            assert (error <= tol * (1.0 + expected[key].abs())).all(), (case, key, error.max())
        if case["gap"] < 1e-3:  # near the reference: the KL's relative error
            true_kl = expected["kl"]
            assert (true_kl < 1e-7).all() and (true_kl > 0).all(), true_kl
            relative = ((per_rank[0][index]["kl"] - true_kl).abs() / true_kl).max().item()
            assert relative < 1e-2, (case, relative)  # the accuracy suite's bound at eps = 1e-4 is 5e-2


def _as_the_gpu_passes_them(launches):
    """The recorded launches, the same at the GPU's widest block, and those the GPU makes for bf16 / fp16 logits:
    compiled kernels read them as they are (the interpreter's launches upcast them first)."""
    variants = list(launches)
    for launch in launches:  # the GPU's widest block, too
        variants.append(dict(launch, constexprs=dict(launch["constexprs"], BLOCK=triton_stats.BLOCK)))
    for launch in launches:
        if launch["signature"].get("x_ptr") != "*fp32":
            continue
        for low in ("*bf16", "*fp16"):
            signature = dict(launch["signature"])
            for name in ("x_ptr", "y_ptr", "out_ptr"):
                if signature.get(name) == "*fp32" and (name != "out_ptr" or launch["kernel"] == "row_grad"):
                    signature[name] = low
            variants.append(dict(launch, signature=signature))
    return variants


def test_every_launch_compiles_for_hopper_and_passes_no_float_scalar(interpreter, monkeypatch):
    """What the interpreter does not check, checked without a GPU: every launch the dispatcher makes (float32 and
    float64, truncated or not, the second read of E[u], bf16 / fp16 logits) compiles through Triton's front end,
    LLVM and ptxas for sm_90 (an H100), and no launch passes a float scalar (compiled kernels type a Python float
    as float32: 1 / tau would carry 2^-24 relative error into every float64 statistic)."""
    cases = [case for case in _edge_cases() if case["seed"] in (1, 2, 3)]
    cases += [dict(case, scale=2500.0, gap=2500.0) for case in cases[:2]]  # unrelated logits ~1e4: E[u] read again
    monkeypatch.setenv(triton_stats.BLOCK_ENV, "16")  # several blocks a row (the drift that sends E[u] to a 2nd read)
    launches = distributed.run_ranks(launch_worker, 1, cases)[0]
    assert {launch["kernel"] for launch in launches} == {"row_partials", "row_grad", "row_mean_u"}
    assert {launch["constexprs"].get("TRUNCATED") for launch in launches} == {False, True}
    floats = sorted(
        {
            (launch["kernel"], name, kind)
            for launch in launches
            for name, kind in launch["signature"].items()
            if not kind.startswith(("*", "i", "u"))
        }
    )
    assert not floats, f"float scalar arguments (float32 once compiled): {floats}"
    unique = {json.dumps(launch, sort_keys=True): launch for launch in _as_the_gpu_passes_them(launches)}
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.distributed.triton_compile", "90"],
        cwd=root,
        env=env,
        input=json.dumps(list(unique.values())),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["errors"], json.dumps(result["errors"][:3], indent=1)
    assert result["compiled"] == len(unique)


def test_dispatch_follows_the_device_and_the_switch(monkeypatch):
    cpu = torch.empty(0)
    monkeypatch.delenv(triton_stats.ENV, raising=False)
    assert not triton_stats.enabled(cpu)
    assert "CPU kernels" in triton_stats.describe(cpu.device)
    monkeypatch.setenv(triton_stats.ENV, "0")
    assert not triton_stats.enabled(cpu)
    monkeypatch.setenv(triton_stats.ENV, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_stats.enabled(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_stats.enabled(cpu)
    assert "Triton interpreter" in triton_stats.describe(cpu.device)
    monkeypatch.setenv(triton_stats.BLOCK_ENV, "24")
    with pytest.raises(ValueError, match="power of two"):
        triton_stats._block(100)
