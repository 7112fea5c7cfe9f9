"""A NaN/inf gradient skips the optimizer step (weights, Adam state and LR schedule untouched on every rank,
megatron's update_successful=False); the trainer counts skips and stops after train.max_consecutive_skips."""

import pytest
import torch

from megatron_kl.config import ModelConfig, ParallelConfig
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.step import NonFiniteUpdates, StepContext, record_update
from megatron_kl.validation.model_workers import nonfinite_step_worker

MODEL = ModelConfig(architecture="qwen2", num_layers=2, vocab_size=50, make_vocab_size_divisible_by=16)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_nan_gradient_skips_the_step_on_every_rank(tp, pp):
    tokens = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(4, 9)
    mask[:, 3:] = 1
    outs = run_ranks(
        nonfinite_step_worker, tp * pp, MODEL, ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), tokens, mask
    )
    for out in outs:
        assert out["bad"]["update_successful"] is False and out["unchanged"]
        assert out["lr"][0] == out["lr"][1]  # the LR schedule did not advance
        assert out["good"]["update_successful"] is True and out["changed_after_good"] and out["finite_after_good"]


def test_consecutive_skips_stop_the_run_with_a_clear_error():
    ctx = StepContext(cfg=None, train_state=None, reference=[], reference_head=None, offload=None)
    assert record_update(ctx, False, 3, 2) is False and record_update(ctx, False, 3, 2) is False
    assert record_update(ctx, True, 4, 2) is True and ctx.consecutive_skips == 0  # a good step resets the count
    record_update(ctx, False, 5, 2)
    record_update(ctx, False, 5, 2)
    with pytest.raises(NonFiniteUpdates, match="3 optimizer steps in a row.*train.max_consecutive_skips=2"):
        record_update(ctx, False, 6, 2)
