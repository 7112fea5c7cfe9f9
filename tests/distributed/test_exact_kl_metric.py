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
        print(f"TP={tp} eps={result['eps']} fused={result['fused']}: KL/token {expected[on].mean():.2e}, "
              f"max relative error {rel:.2e}")
        assert rel <= TOLERANCE[result["eps"]], (result["eps"], result["fused"], rel)
        assert (result["kl"][~on] == 0).all()
