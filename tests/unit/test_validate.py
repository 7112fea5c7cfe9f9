"""megatron-kl validate's check runner: a failing check shows its exit code and log tail, a hanging one is
stopped at its deadline, a check this node cannot run is a skip with the reason; the plan matches the node."""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_kl.launch.node_check import plan_checks


def test_validate_reports_a_failing_and_a_hanging_check(tmp_path):
    from megatron_kl.launch.node_check import Check, run_check

    failed = run_check(
        Check("boom", [sys.executable, "-c", "print('the tail'); raise SystemExit(3)"]), tmp_path, tmp_path
    )
    assert failed.status == "fail" and "exit code 3" in failed.detail and "the tail" in failed.detail
    hung = run_check(
        Check("hang", [sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1), tmp_path, tmp_path
    )
    assert hung.status == "fail" and "timed out after 1s" in hung.detail
    skipped = run_check(Check("tp8", ["false"], skip="TP=8 needs 8 GPUs"), tmp_path, tmp_path)
    assert skipped.status == "skip" and skipped.detail == "TP=8 needs 8 GPUs"


def test_the_plan_follows_the_node():
    cpu = {c.name: c for c in plan_checks(0, Path("run"))}
    assert (
        cpu["gpu_tests"].skip == "no GPU on this node" and cpu["vocab_parallel"].env["MEGATRON_KL_TEST_WORLDS"] == "2"
    )
    assert (
        cpu["train"].skip is None
        and "rollout.sglang.server_module=megatron_kl.testing.sglang_server" in cpu["train"].command
    )
    node = {c.name: c for c in plan_checks(8, Path("run"), "/models/qwen")}
    assert all(c.skip is None for c in node.values())
    assert node["fused_linear"].env["MEGATRON_KL_TEST_WORLDS"] == "8"
    assert "init.hf_checkpoint=/models/qwen" in node["train"].command
    assert "rollout.sglang.weight_sync=from_distributed" in node["train"].command
    two = {c.name: c for c in plan_checks(2, Path("run"))}
    assert "8 GPUs" in two["vocab_parallel"].skip and "4 GPUs" in two["layouts"].skip and "3 GPUs" in two["train"].skip
