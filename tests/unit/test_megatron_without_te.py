"""megatron-core without Transformer Engine on a CUDA machine: the one fix that applies there too."""

import subprocess
import sys

import pytest

PROBE = """
import torch
torch.cuda.is_available = lambda: True  # a GPU machine, as far as the shims can tell
from megatron_kl.megatron_compat import apply_cpu_shims
from megatron.core.transformer.moe import moe_utils
assert apply_cpu_shims() is False  # no CPU shim on a GPU machine
assert moe_utils.te_general_gemm is None
g = torch.Generator().manual_seed(0)
inp = torch.randn(5, 8, generator=g, dtype=torch.float64).requires_grad_(True)
weight = torch.randn(4, 8, generator=g, dtype=torch.float64).requires_grad_(True)
out = moe_utils.router_gating_linear(inp.float(), weight.float(), None, torch.float32)
assert torch.allclose(out.double(), inp @ weight.t(), atol=1e-5), (out, inp @ weight.t())
out.sum().backward()
assert torch.allclose(inp.grad, weight.sum(0).expand_as(inp), atol=1e-5)
print("ok")
"""


@pytest.mark.fast
def test_the_moe_router_runs_without_transformer_engine_where_cuda_is():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine is installed: its te_general_gemm is used")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
