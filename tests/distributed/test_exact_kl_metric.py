"""The trainer's exact-KL metric where RL starts: policy and reference differ by eps in the output weight
(per-token KL ~1e-5 .. 1e-7), through ``compute_token_stats`` as ``rl_step``'s old pass runs it, on the
unfused (logits) and fused linear paths, TP=1 and TP=2, against float64 from the same hidden states and
weights. Judged by relative error per token."""

import pytest
import torch

from megatron_kl.config import ModelConfig, ParallelConfig
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.validation.model_workers import exact_kl_metric_worker

MODEL = ModelConfig(architecture="qwen2", num_layers=2, vocab_size=50, make_vocab_size_divisible_by=16)
TOLERANCE = {1e-2: 1e-2, 1e-3: 1e-2}


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_exact_kl_metric_near_the_reference(tp):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (4, 10), generator=g)
    mask = torch.zeros(4, 9)
    mask[:, 3:] = 1
    settings = [(eps, fused) for eps in TOLERANCE for fused in (False, True)]
    outs = run_ranks(exact_kl_metric_worker, tp, MODEL, ParallelConfig(tensor_parallel=tp), tokens, mask, settings)
    vocab = MODEL.vocab_size
    for result in outs[0]:
        h = result["hidden"][:, :-1].double()
        h_ref = result["reference_hidden"][:, :-1].double()
        logp = torch.log_softmax((h @ result["weight"].double().t())[..., :vocab], -1)
        logq = torch.log_softmax((h_ref @ result["reference_weight"].double().t())[..., :vocab], -1)
        expected = (logp.exp() * (logp - logq)).sum(-1)
        on = mask.bool()
        rel = ((result["kl"][on].double() - expected[on]).abs() / expected[on]).max().item()
        print(
            f"TP={tp} eps={result['eps']} fused={result['fused']}: KL/token {expected[on].mean():.2e}, "
            f"max relative error {rel:.2e}"
        )
        assert rel <= TOLERANCE[result["eps"]], (result["eps"], result["fused"], rel)
        assert (result["kl"][~on] == 0).all()


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_exact_kl_is_zero_at_the_reference_and_exact_near_it(ep):
    """A mixture-of-experts policy (experts split over ``ep`` ranks): with the reference equal to the policy the
    exact KL of every position is below 1e-8 (the step-0 gate), and near it it matches float64 as above."""
    from megatron_kl.config import MoEConfig

    model = ModelConfig(
        architecture="qwen3",
        num_layers=2,
        vocab_size=50,
        make_vocab_size_divisible_by=16,
        moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32),
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (4, 10), generator=g)
    mask = torch.zeros(4, 9)
    mask[:, 3:] = 1
    settings = [(eps, fused) for eps in (0.0, 1e-2) for fused in (False, True)]
    outs = run_ranks(exact_kl_metric_worker, ep, model, ParallelConfig(expert_parallel=ep), tokens, mask, settings)
    on = mask.bool()
    for result in outs[0]:
        if result["eps"] == 0.0:
            assert result["kl"][on].abs().max().item() < 1e-8, result["fused"]
            continue
        h = result["hidden"][:, :-1].double()
        logp = torch.log_softmax((h @ result["weight"].double().t())[..., :50], -1)
        logq = torch.log_softmax((h @ result["reference_weight"].double().t())[..., :50], -1)
        expected = (logp.exp() * (logp - logq)).sum(-1)
        rel = ((result["kl"][on].double() - expected[on]).abs() / expected[on]).max().item()
        assert rel <= 1e-2, (result["fused"], rel)
