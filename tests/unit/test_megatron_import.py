"""megatron-core imported on a CPU machine with its torch.compile decorators deferred to the first call: what runs is
what torch.compile runs (it compiles on the first call too), and a process that never calls them never imports
TorchDynamo's compiler."""

import subprocess
import sys

import pytest
import torch

from megatron_kl.megatron_compat import _compile_on_first_call


def test_the_deferred_compile_compiles_once_on_the_first_call_with_the_given_options():
    calls = []

    def real_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    compile_later = _compile_on_first_call(real_compile)

    @compile_later
    def plain(x):
        return x + 1

    @compile_later(mode="max-autotune", dynamic=False)
    def with_options(x):
        return x * 2

    assert calls == [] and plain.__name__ == "plain"  # decorating compiles nothing
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(3) == ("compiled", 6)
    assert calls == [("plain", {}), ("with_options", {"mode": "max-autotune", "dynamic": False})]


PROBE = """
import sys, torch
real = torch.compile
from megatron_kl.megatron_compat import import_megatron_core
import_megatron_core()
from megatron.core.fusions import fused_bias_geglu
assert torch.compile is real  # restored once megatron-core is imported
assert "torch._inductor.compile_fx" not in sys.modules
assert fused_bias_geglu.geglu.__wrapped__.__name__ == "geglu"  # decorated, not compiled
print("ok")
"""


def test_importing_megatron_core_on_a_cpu_defers_its_compiles_and_restores_torch_compile():
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine megatron-core is imported as it is")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
