"""logging.profile_steps: the per-phase summary attributes ops to the phase whose range holds them, and a
profiled step of a real run writes its trace, op table and summary (tests/e2e/test_train.py runs the trainer)."""

import time
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_kl.config import ConfigError
from megatron_kl.train.config import LoggingConfig
from megatron_kl.train.profiling import PHASES, phase, summarize


def _event(name, start_us, end_us, self_us=None):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start_us, end=end_us),
        self_cpu_time_total=(end_us - start_us) if self_us is None else self_us,
        self_device_time_total=0.0,
    )


def test_summary_attributes_ops_by_the_range_that_holds_their_start():
    events = [
        _event("megatron_kl/reference", 100, 200),
        _event("megatron_kl/update", 300, 600),
        _event("aten::mm", 110, 150),
        _event("aten::add", 150, 160),  # reference: 40 us GEMM, 10 us other
        _event("aten::addmm", 310, 400),
        _event("aten::bmm", 400, 420),  # update: 110 us GEMM
        _event("aten::mul", 420, 425),
        _event("aten::mm", 250, 270),  # between the ranges: other
        _event("aten::mm", 700, 710),  # after every range: other
        _event("autograd::engine::evaluate_function", 310, 500),  # not an aten op: not counted
    ]
    out = summarize(events, step_seconds=1e-3)
    ref, update, other = (out["phases"][k] for k in ("reference", "update", "other"))
    assert ref["gemm_s"] == pytest.approx(40e-6) and ref["ops_s"] == pytest.approx(50e-6) and ref["ops"] == 2
    assert update["gemm_s"] == pytest.approx(110e-6) and update["ops"] == 3
    assert other["gemm_s"] == pytest.approx(30e-6) and other["ops"] == 2
    assert ref["wall_s"] == pytest.approx(100e-6) and update["wall_s"] == pytest.approx(300e-6)
    assert other["wall_s"] == pytest.approx(1e-3 - 400e-6)
    assert out["gemm_s"] == pytest.approx(180e-6)
    assert out["phases"]["rollout_wait"]["ops"] == 0


def test_real_profile_puts_the_matmul_in_its_phase():
    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with phase("update"):
            torch.mm(a, a)
        with phase("reference"):
            torch.relu(a)
    out = summarize(prof.events(), step_seconds=1.0)
    assert out["phases"]["update"]["gemm_s"] > 0 and out["phases"]["update"]["ops"] >= 1
    assert out["phases"]["reference"]["gemm_s"] == 0 and out["phases"]["reference"]["ops"] >= 1
    assert out["gemm_s"] == pytest.approx(out["phases"]["update"]["gemm_s"])


def test_unknown_phase_and_bad_steps_are_named():
    with pytest.raises(ValueError, match="unknown phase"):
        phase("rollout")
    assert "rollout_wait" in PHASES
    assert LoggingConfig(profile_steps=3).profile_steps == [3]
    for bad in ([-1], ["a"], [True], "abc", 1.5):
        with pytest.raises(ConfigError, match="logging.profile_steps"):
            LoggingConfig(profile_steps=bad)


def test_phase_times_its_block_into_the_step_metrics_even_when_it_raises():
    timings = {}
    with phase("update", timings):
        time.sleep(0.02)
    assert 0.02 <= timings["time/update"] < 1.0
    with pytest.raises(RuntimeError, match="server gone"):
        with phase("weight_sync", timings):
            raise RuntimeError("server gone")
    assert 0 <= timings["time/weight_sync"] < timings["time/update"]
    with phase("reference"):  # no dict: a range only
        pass
    assert set(timings) == {"time/update", "time/weight_sync"}
