"""TP=2, PP=2 (1F1B, several microbatches), sequence parallel and context parallel (CP=2: Transformer Engine, two
GPUs) reproduce TP=1/PP=1:
logits, per-token log-probs, entropies, parameter gradients and the weights after one optimizer step.
Also: the reference model is frozen and unchanged by a policy update."""

import dataclasses

import pytest
import torch

from megatron_kl.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_kl.models.builder import have_transformer_engine
from megatron_kl.models.optim import OptimConfig
from megatron_kl.models.pipeline import SequenceBatch
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.validation.model_workers import layout_worker

MODELS = {
    # Qwen2 style: qkv bias, untied embeddings, GQA; vocab 50 padded to 64 (32 x TP=2)
    "qwen2": ModelConfig(architecture="qwen2", num_layers=4, vocab_size=50, make_vocab_size_divisible_by=16),
    # Qwen3 style: q/k RMSNorm, tied embeddings
    "qwen3": ModelConfig(
        architecture="qwen3", num_layers=4, vocab_size=50, make_vocab_size_divisible_by=16, tie_word_embeddings=True
    ),
    # Qwen3-MoE style: 4 experts, top-2 renormalised, expert width 32 (megatron-core MoELayer, allgather dispatcher)
    "qwen3_moe": ModelConfig(
        architecture="qwen3",
        num_layers=4,
        vocab_size=50,
        make_vocab_size_divisible_by=16,
        moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32),
    ),
}
# Adam's first step is lr * g / (|g| + eps): a large eps keeps fp32 noise in near-zero grads from
# being amplified (the key bias has zero true gradient: softmax is shift invariant, so its gradient is pure
# rounding noise, which lr/eps scales), so the updated weights can be compared tightly.
OPTIM = OptimConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1.0)
NUM_MICROBATCHES = 4


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (8, 12), generator=g)
    mask = torch.zeros(8, 11)
    mask[:, 4:] = 1
    mask[1, 9:] = 0  # shorter responses: rows need 12, 10, 12, 7, 12, 8, 12, 12 tokens
    mask[3, 6:] = 0
    mask[5, 7:] = 0
    return tokens, mask


@pytest.fixture(scope="module")
def baselines():
    tokens, mask = _batch()
    out = {}
    for name, model in MODELS.items():
        out[name] = run_ranks(layout_worker, 1, model, ParallelConfig(), None, tokens, mask, NUM_MICROBATCHES, OPTIM)[0]
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str):
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: max error relative to scale {err.item():.3e} > {rtol}"
    return err.item()


def _compare(result: dict, base: dict, outs: list):
    last = next(o for o in outs if o["is_last_stage"])
    _close(last["logits"], base["logits"], 1e-5, "logits")
    for key in ("logprobs", "entropy"):
        for o in outs:  # every rank got the last stage's values
            _close(o[key], base[key], 1e-5, key)
    assert set(result["grads"]) == set(base["grads"])
    for name in base["grads"]:
        _close(result["grads"][name], base["grads"][name], 1e-5, f"grad {name}")
        _close(result["updated"][name], base["updated"][name], 1e-5, f"updated {name}")
    assert abs(result["grad_norm"] - base["grad_norm"]) <= 1e-5 * base["grad_norm"]
    for o in outs:
        assert not o["reference_requires_grad"]
        torch.testing.assert_close(o["reference_after"], o["reference_before"], rtol=0, atol=0)
    # the step really moved the policy away from the reference
    moved = max((result["updated"][k] - base["full_state"][k]).abs().max().item() for k in base["full_state"])
    assert moved > 1e-4


@pytest.mark.parametrize(
    "model_name,parallel",
    [
        ("qwen2", ParallelConfig(tensor_parallel=2)),
        ("qwen2", ParallelConfig(pipeline_parallel=2)),
        ("qwen3", ParallelConfig(tensor_parallel=2)),
        pytest.param(
            "qwen3",
            ParallelConfig(tensor_parallel=2, sequence_parallel=True),
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not have_transformer_engine(), reason="sequence parallel needs Transformer Engine"),
            ],
        ),
        ("qwen3", ParallelConfig(pipeline_parallel=2)),
        ("qwen2", ParallelConfig(tensor_parallel=2, pipeline_parallel=2)),
        pytest.param(
            "qwen3",
            ParallelConfig(context_parallel=2),
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not have_transformer_engine() or torch.cuda.device_count() < 2,
                    reason="context parallelism needs Transformer Engine and two GPUs",
                ),
            ],
        ),
    ],
    ids=["tp2", "pp2-1f1b", "tp2-tied-qknorm", "tp2-sp-tied-qknorm", "pp2-tied-qknorm", "tp2-pp2-4ranks", "cp2"],
)
def test_layout_matches_single_rank(baselines, model_name, parallel):
    tokens, mask = _batch()
    base = baselines[model_name]
    world = parallel.tensor_parallel * parallel.pipeline_parallel * parallel.context_parallel
    outs = run_ranks(
        layout_worker, world, MODELS[model_name], parallel, base["full_state"], tokens, mask, NUM_MICROBATCHES, OPTIM
    )
    _compare(outs[0], base, outs)


@pytest.mark.parametrize(
    "model_name,parallel",
    [
        ("qwen2", ParallelConfig()),
        ("qwen3", ParallelConfig(tensor_parallel=2)),
        ("qwen2", ParallelConfig(pipeline_parallel=2)),
    ],
    ids=["tp1", "tp2-tied-qknorm", "pp2"],
)
def test_local_kernels_match_megatron_and_torch_modules(baselines, model_name, parallel):
    """model.core_attention=sdpa (torch SDPA, models/attention.py) and model.rms_norm=lean (models/norm.py) give
    the single-rank baseline's logits, log-probs, gradients and updated weights, computed by megatron-core's
    DotProductAttention and torch.nn.RMSNorm (``auto`` in float32)."""
    tokens, mask = _batch()
    base = baselines[model_name]
    local = dataclasses.replace(MODELS[model_name], core_attention="sdpa", rms_norm="lean")
    world = parallel.tensor_parallel * parallel.pipeline_parallel
    outs = run_ranks(layout_worker, world, local, parallel, base["full_state"], tokens, mask, NUM_MICROBATCHES, OPTIM)
    assert base["core_attention"] == ["DotProductAttention"] and base["rms_norms"] == ["RMSNorm"]
    assert all(o["core_attention"] == ["SDPAttention"] and o["rms_norms"] == ["LeanRMSNorm"] for o in outs)
    _compare(outs[0], base, outs)


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(pipeline_parallel=2)], ids=["tp1", "pp2-1f1b"])
def test_full_activation_recomputation_matches_kept_activations(baselines, parallel):
    """model.recompute=full (megatron's full, uniform recomputation, one layer per checkpoint: each layer rerun in
    backward from its input) gives the baseline's logits, log-probs, gradients and updated weights."""
    tokens, mask = _batch()
    base = baselines["qwen2"]
    recompute = dataclasses.replace(MODELS["qwen2"], recompute="full")
    outs = run_ranks(
        layout_worker,
        parallel.pipeline_parallel,
        recompute,
        parallel,
        base["full_state"],
        tokens,
        mask,
        NUM_MICROBATCHES,
        OPTIM,
    )
    assert base["recompute"] is None and all(o["recompute"] == "full" for o in outs)
    _compare(outs[0], base, outs)


def test_reference_frozen_single_rank(baselines):
    base = baselines["qwen2"]
    assert not base["reference_requires_grad"]
    torch.testing.assert_close(base["reference_after"], base["reference_before"], rtol=0, atol=0)
    # the policy's own log-probs equal the reference's before the update (same weights)
    torch.testing.assert_close(base["logprobs"], base["reference_before"], rtol=0, atol=0)


@pytest.mark.parametrize(
    "model_name,parallel",
    [
        ("qwen2", ParallelConfig()),
        ("qwen2", ParallelConfig(tensor_parallel=2)),
        ("qwen3", ParallelConfig(tensor_parallel=2)),
        ("qwen3", ParallelConfig(pipeline_parallel=2)),
    ],
    ids=["tp1", "tp2", "tp2-tied-qknorm", "pp2-tied-qknorm"],
)
@pytest.mark.parametrize("grad_in_forward", [False, True], ids=["recompute", "in-forward"])
def test_fused_linear_path_matches_unfused_single_rank(baselines, model_name, parallel, grad_in_forward):
    """model.logprob_path=fused (output layer bypassed, tied embedding as the output weight) gives the
    unfused single-rank log-probs, entropies, gradients and updated weights, with the gradients recomputed
    in backward or formed in the forward pass (model.fused_grad)."""
    tokens, mask = _batch()
    base = baselines[model_name]
    world = parallel.tensor_parallel * parallel.pipeline_parallel
    outs = run_ranks(
        layout_worker,
        world,
        MODELS[model_name],
        parallel,
        base["full_state"],
        tokens,
        mask,
        NUM_MICROBATCHES,
        OPTIM,
        True,
        grad_in_forward,
    )
    _compare(outs[0], base, outs)
    last_stage = [o for o in outs if o["probes"]]
    assert bool(last_stage) == grad_in_forward  # the single pass ran (on the last pipeline stage) or did not


@pytest.mark.parametrize(
    "model_name,parallel,fused",
    [
        ("qwen2", ParallelConfig(), False),
        ("qwen3", ParallelConfig(), True),
        ("qwen2", ParallelConfig(pipeline_parallel=2), False),
        ("qwen3", ParallelConfig(tensor_parallel=2), True),
    ],
    ids=["tp1", "tp1-fused-single-pass", "pp2-1f1b", "tp2-fused-single-pass"],
)
def test_token_budget_microbatches_match_equal_slices(baselines, model_name, parallel, fused):
    """train.micro_batch_tokens: rows sorted by length and packed into microbatches of <= 24 padded tokens
    (here 4 microbatches of widths 12, 12, 12, 8, not the batch's 12 everywhere) give the equal-slice
    single-rank log-probs, entropies, gradients and updated weights; at PP=2 the stages exchange the
    varying shapes."""
    tokens, mask = _batch()
    plan = SequenceBatch(tokens, mask).split(1, 24)
    assert [tuple(mb.tokens.shape) for mb in plan] == [(2, 12), (2, 12), (2, 12), (2, 8)]
    base = baselines[model_name]
    world = parallel.tensor_parallel * parallel.pipeline_parallel
    outs = run_ranks(
        layout_worker,
        world,
        MODELS[model_name],
        parallel,
        base["full_state"],
        tokens,
        mask,
        NUM_MICROBATCHES,
        OPTIM,
        fused,
        fused,
        24,
    )
    _compare(outs[0], base, outs)


@pytest.mark.parametrize(
    "model_name,parallel,fused",
    [
        ("qwen2", ParallelConfig(), False),
        ("qwen3", ParallelConfig(tensor_parallel=2), True),
        ("qwen2", ParallelConfig(pipeline_parallel=2), False),
    ],
    ids=["tp1", "tp2-tied-qknorm-fused-single-pass", "pp2-1f1b"],
)
def test_bf16_mixed_precision_tracks_float32(baselines, model_name, parallel, fused):
    """model.params_dtype=bfloat16 (weights and activations in bf16, megatron's mixed-precision optimizer with
    float32 main weights and float32 gradient sums), from the float32 baseline's weights: logits, log-probs,
    entropies, gradients and the updated weights agree with float32 to bf16 precision (2^-8 = 3.9e-3 per
    rounding, a few roundings deep), every parameter is bf16 and every optimizer parameter a float32 main copy.
    Also PP=2 (bf16 activations between stages) and TP=2 on the fused single pass."""
    tokens, mask = _batch()
    base = baselines[model_name]
    world = parallel.tensor_parallel * parallel.pipeline_parallel
    bf16 = dataclasses.replace(MODELS[model_name], params_dtype="bfloat16")
    outs = run_ranks(
        layout_worker, world, bf16, parallel, base["full_state"], tokens, mask, NUM_MICROBATCHES, OPTIM, fused, fused
    )
    result = outs[0]
    for o in outs:
        assert o["param_dtypes"] == ["torch.bfloat16"] and o["main_param_dtypes"] == ["torch.float32"]
        assert o["core_attention"] == ["SDPAttention"] and o["rms_norms"] == ["LeanRMSNorm"]  # auto in bf16
    last = next(o for o in outs if o["is_last_stage"])
    _close(last["logits"].float(), base["logits"], 2e-2, "bf16 logits")
    for key in ("logprobs", "entropy"):
        for o in outs:
            _close(o[key], base[key], 2e-2, f"bf16 {key}")
    errors = [_close(result["grads"][n].float(), base["grads"][n], 4e-2, f"bf16 grad {n}") for n in base["grads"]]
    assert max(errors) > 1e-4  # bf16 really ran: float32 would agree to ~1e-6
    assert abs(result["grad_norm"] - base["grad_norm"]) <= 2e-2 * base["grad_norm"]
    for name, expected in base["updated"].items():
        # bf16(main - step): the weight's own rounding (2^-8 of its scale) plus a step difference well under
        # lr (Adam's step is at most ~lr; zero-initialised biases have a scale of lr itself)
        diff = (result["updated"][name].float() - expected).abs().max().item()
        assert diff <= 2**-8 * expected.abs().max().item() + 0.2 * OPTIM.lr, f"bf16 updated {name}: {diff:.2e}"
    moved = max(
        (result["updated"][k].float() - base["full_state"][k].to(torch.bfloat16).float()).abs().max().item()
        for k in base["full_state"]
    )
    assert moved > 1e-4


@pytest.mark.parametrize(
    "parallel,world,fused",
    [
        (ParallelConfig(expert_parallel=2), 2, False),
        (ParallelConfig(expert_parallel=2), 2, True),
        (ParallelConfig(pipeline_parallel=2, expert_parallel=2), 4, False),
        pytest.param(
            ParallelConfig(tensor_parallel=2, sequence_parallel=True, expert_parallel=2),
            4,
            True,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not have_transformer_engine(), reason="sequence parallel needs Transformer Engine"),
            ],
        ),
    ],
    ids=["ep2", "ep2-fused-single-pass", "pp2-ep2-1f1b", "tp2-sp-ep2-fused-single-pass"],
)
def test_expert_parallel_layouts_match_single_rank(baselines, parallel, world, fused):
    """A mixture-of-experts policy split over expert-parallel ranks (the data-parallel ranks of a stage, here all
    fed the same batch) reproduces EP=1: logits, log-probs, entropies (the vocab-parallel kernels and the fused
    output path under EP), every expert's gradient and its weights after one optimizer step. TP x EP trains only
    with sequence parallelism (megatron-core's MoE layer), so on GPUs with Transformer Engine."""
    tokens, mask = _batch()
    base = baselines["qwen3_moe"]
    assert any(".mlp.experts.local_experts.3." in name for name in base["grads"])
    outs = run_ranks(
        layout_worker,
        world,
        MODELS["qwen3_moe"],
        parallel,
        base["full_state"],
        tokens,
        mask,
        NUM_MICROBATCHES,
        OPTIM,
        fused,
        fused,
    )
    _compare(outs[0], base, outs)
