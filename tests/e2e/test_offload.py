"""parallel.offload_reference: same reference log-probs, weights on the host between passes."""

import pytest
import torch

from megatron_kl.testing.distributed import run_ranks
from tests.e2e.test_engine import MODEL
from tests.e2e.workers import offload_worker


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves weights between GPU and host")
def test_offloaded_reference_matches_resident_reference_on_gpu():
    out = run_ranks(offload_worker, 1, MODEL)[0]
    assert out["enabled"] and out["host_between"] and out["host_after"]
    torch.testing.assert_close(out["offloaded"], out["resident"], rtol=0, atol=0)


def test_offload_is_a_no_op_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    out = run_ranks(offload_worker, 1, MODEL)[0]
    assert not out["enabled"]
    torch.testing.assert_close(out["offloaded"], out["resident"], rtol=0, atol=0)
