"""train.host_malloc: glibc malloc thresholds on CPU-only processes, the user's MALLOC_* environment first."""

import json
import os
import subprocess
import sys

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.run.host_malloc import SETTINGS, _glibc, tune_host_malloc

PROBE = (
    "import json; from megatron_kl.run.host_malloc import tune_host_malloc; "
    "print(json.dumps(tune_host_malloc('auto', cuda=False)))"
)


def _probe(env: dict) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="not glibc")
def test_auto_sets_both_thresholds_on_cpu_and_leaves_the_users_environment_alone():
    assert _probe({}) == {name: value for name, (_, value, _) in SETTINGS.items()}
    assert _probe({"MALLOC_TRIM_THRESHOLD_": "131072"}) == {"M_MMAP_MAX": 0, "M_MMAP_THRESHOLD": 32 << 20}


FAULTS = """
import resource, sys, torch
from megatron_kl.run.host_malloc import tune_host_malloc
tune_host_malloc(sys.argv[1], cuda=False)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a training step's shape: a 64 MiB temporary and 256 MiB of activations kept, then all freed
    kept = [torch.ones(1 << 20) for _ in range(64)]
    torch.ones(16 << 20).sum()
    del kept
step()
step()  # the heap's layout settles over two steps (the second may still place its 64 MiB block above the first's)
before = faults()
for _ in range(4):
    step()
print(faults() - before)
"""


@pytest.mark.skipif(_glibc() is None, reason="not glibc")
def test_auto_stops_the_steps_memory_being_page_faulted_anew():
    """With glibc's defaults a step faults much of its 320 MiB in again (the 64 MiB block mmapped per use, freed
    heap trimmed); with ``auto`` the pages of the earlier steps are reused. Measured after two warm-up steps: the
    second step faulted 1024-16384 pages in 8 + 6 runs (sometimes the whole 64 MiB block, which made a one-step
    warm-up flaky against this bound), every later step 0."""
    pages = {}
    for mode in ("off", "auto"):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run(
            [sys.executable, "-c", FAULTS, mode], env=clean, capture_output=True, text=True, check=True
        )
        pages[mode] = int(out.stdout.strip().splitlines()[-1])
    assert pages["off"] > 4 * (64 << 20) // 4096, pages  # at least the 64 MiB block, every step
    assert pages["auto"] < 0.05 * 4 * (320 << 20) // 4096, pages  # measured 6144 of 327680 (off: 132101)


def test_off_and_cuda_processes_keep_glibc_defaults():
    assert tune_host_malloc("off", cuda=False) == {}
    assert tune_host_malloc("auto", cuda=True) == {}
    with pytest.raises(ValueError, match="train.host_malloc='jemalloc'"):
        tune_host_malloc("jemalloc", cuda=False)


def test_config_names_the_field():  # train.host_malloc and train.micro_batch_tokens
    from megatron_kl.config import from_dict
    from megatron_kl.train.config import TrainConfig

    with pytest.raises(ConfigError, match="train.host_malloc='fast'"):
        from_dict(TrainConfig, {"train": {"host_malloc": "fast"}})
    assert from_dict(TrainConfig, {"train": {"host_malloc": False}}).train.host_malloc == "off"  # YAML `off`
    with pytest.raises(ConfigError, match="train.micro_batch_tokens=64 and train.micro_batches=2"):
        from_dict(TrainConfig, {"train": {"micro_batch_tokens": 64, "micro_batches": 2}})
    with pytest.raises(ConfigError, match="train.micro_batch_tokens=-1"):
        from_dict(TrainConfig, {"train": {"micro_batch_tokens": -1}})
