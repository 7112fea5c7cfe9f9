"""scripts/gpu_checks.sh without a GPU: its dry run (every check's command at toy sizes, the Triton kernels through
the interpreter, the test selections collected) passes and writes each result; a failing check is recorded and
the next one runs; a spent budget skips the checks left, saying so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
CHECKS = (
    "environment",
    "rl_steps",
    "kernel_tests",
    "bench_logits",
    "bench_truncation",
    "bench_linear",
    "bench_teacher",
    "rest",
)

pytest.importorskip("triton")


def _run(out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_dry_run_passes_every_check_and_writes_each_result(tmp_path):
    done = _run(tmp_path / "out", DRY_RUN="1")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:]
    for name in CHECKS:
        assert f"{name} " in summary and (tmp_path / "out" / f"{name}.log").exists(), name
    assert "checks not passed: 0" in summary
    logits = (tmp_path / "out" / "bench_logits.log").read_text()
    for impl in ("megatron_core_logprobs", "triton_exact_kl", "torch_exact_kl", "naive_exact_kl", "% copy bw"):
        assert impl in logits, impl
    assert "Triton interpreter" in logits and "bfloat16" in logits


def test_a_failing_check_is_recorded_and_a_spent_budget_skips_the_rest(tmp_path):
    done = _run(tmp_path / "out", DRY_RUN="1", CHECKS="environment rl_steps", PYTHON="false")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert done.returncode == 2, summary
    assert "environment" in summary and "rl_steps" in summary and "checks not passed: 2" in summary
    done = _run(tmp_path / "spent", DRY_RUN="1", CHECKS="environment", BUDGET_S="5")
    summary = (tmp_path / "spent" / "summary.txt").read_text()
    assert done.returncode == 1 and "skipped: the budget" in summary, summary
