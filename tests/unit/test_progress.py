"""The progress a run shows: one bar within 80 columns on a terminal, plain per-step lines elsewhere, the total wall
time at the end."""

import io
import logging
import re

from rich.console import Console

from megatron_kl.train.progress import StepProgress, clock

NAME = "full-loss-token-coef0.01-grpo-ppo-s0-seed1234-abcdef"  # longer than a terminal line allows
METRICS = {
    "reward/mean": 0.853125,
    "kl/exact_token": 0.00123,
    "kl/k3_token": 0.0011,
    "time/step": 0.312,
    "throughput/tokens_per_s": 1520.4,
}


def test_on_an_80_column_terminal_one_labelled_bar_fits():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    progress = StepProgress(NAME, total=60, console=console)
    for done in range(1, 13):
        progress.advance(done, METRICS)
    progress.close(12)
    lines = [
        line
        for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "\n").splitlines()
        if line.strip()
    ]
    last = lines[-1]
    assert len(last) <= 80, last
    assert "12/60" in last and "reward 0.853" in last and "kl 1.2e-03" in last, last
    assert re.search(r"0:00:0\d", last) and "…" not in last, last  # elapsed and remaining shown, nothing cut


def test_elsewhere_plain_lines_with_step_reward_kl_speed_and_remaining(caplog):
    console = Console(file=io.StringIO(), force_terminal=False)
    with caplog.at_level(logging.INFO, logger="megatron_kl.train"):
        progress = StepProgress(NAME, total=6, start_step=2, every=2, console=console)
        for done in range(3, 7):
            progress.advance(done, METRICS)
        progress.close(6)
    lines = [r.getMessage() for r in caplog.records]
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["4/6", "6/6"]  # every 2 steps from the resumed step, and the last
    assert (
        "reward 0.853  " not in steps[0]
        and "reward 0.853 kl/exact 1.23e-03 kl/k3 1.10e-03" in steps[0]
        and "0.31 s/step" in steps[0]
        and "1520 tokens/s" in steps[0]
        and "remaining 0:00:0" in steps[0]
    )
    assert lines[-1].startswith("trained steps 2-5 of 6 in 0:00:0")


def test_the_seconds_rule_adds_lines_between_the_step_rule(caplog, monkeypatch):
    import megatron_kl.train.progress as progress_module

    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.INFO, logger="megatron_kl.train"):
        progress = StepProgress("run", total=100, every=50, every_s=30.0, console=Console(file=io.StringIO()))
        for done in range(1, 5):
            now[0] += 20.0
            progress.advance(done, METRICS)
    assert [r.getMessage().split()[1] for r in caplog.records] == ["2/100", "4/100"]
    assert clock(3725) == "1:02:05"
