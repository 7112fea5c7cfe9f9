"""Short training runs for the end-to-end tests: the CPU default config shortened, a run in a process of its own, and
metrics compared but for timings."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_kl.config import apply_overrides, from_dict
from megatron_kl.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]

DEFAULT = ROOT / "configs" / "cpu" / "default.yaml"

VOLATILE = ("time/", "throughput/", "weight_sync/")  # weight_sync/*: the embedded engine counts its own shards


def short_config(out: Path, cache: str, *overrides: str) -> dict:
    data = yaml.safe_load(DEFAULT.read_text())
    apply_overrides(
        data,
        [
            f"train.output_dir={out}",
            f"warm_start.cache_dir={cache}",
            "train.steps=3",
            "train.prompts_per_step=8",
            "train.group_size=4",
            "task.eval_size=8",
            "eval.k=2",
            "eval.interval=0",
            "checkpoint.interval=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            *overrides,
        ],
    )
    from_dict(TrainConfig, copy.deepcopy(data))  # validate here: a bad override fails before spawning
    return data


def stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def assert_same_metrics(a: list[dict], b: list[dict], what: str) -> None:
    """Two runs' records agree key for key up to fp32 rounding of a different layout (timings aside)."""
    assert len(a) == len(b), what
    for x, y in zip(stable(a), stable(b)):
        assert x.keys() == y.keys(), what
        for key in x:
            if x[key] is None:
                assert y[key] is None, f"{what}: {key}"
                continue
            assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-4), (
                f"{what} step {x['step']} {key}: {x[key]} vs {y[key]}"
            )


class Run:
    """``megatron-kl train`` in a subprocess, output to a file (a killed run's helper processes may keep a
    pipe open)."""

    def __init__(self, log: Path, *args: str):
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            env.pop(key, None)
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "megatron_kl.cli", "train", *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait(self, timeout: float = 600) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        return code, self.log.read_text()
