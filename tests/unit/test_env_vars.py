"""Environment variables are parsed strictly: every spelling of on/off/auto is read as meant, anything else is an
error naming the variable (at ``--check`` too), never a silent default."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kl import env_vars
from megatron_kl.env_vars import AUTO, OFF, ON, EnvVarError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "raw, value",
    [
        ("1", ON),
        ("true", ON),
        ("ON", ON),
        (" yes ", ON),
        ("0", OFF),
        ("false", OFF),
        ("off", OFF),
        ("No", OFF),
        ("", AUTO),
        ("auto", AUTO),
    ],
)
def test_switch_spellings(raw, value):
    assert env_vars.switch("X", {"X": raw}) == value
    assert env_vars.switch("X", {}) == AUTO


@pytest.mark.parametrize("raw", ["abc", "-1", "3", "enabled"])
def test_bad_switch_names_the_variable(raw):
    with pytest.raises(EnvVarError, match=rf"environment variable MEGATRON_KL_TRITON='{raw}': use auto, "):
        env_vars.switch("MEGATRON_KL_TRITON", {"MEGATRON_KL_TRITON": raw})


def test_flags_choices_and_powers_of_two():
    assert env_vars.flag("N", True, {}) is True and env_vars.flag("N", True, {"N": "off"}) is False
    with pytest.raises(EnvVarError, match="N='auto': use 1/true/on/yes or 0/false/off/no"):
        env_vars.flag("N", True, {"N": "auto"})
    assert env_vars.choice("S", ("forkserver", "spawn"), "forkserver", {"S": "spawn"}) == "spawn"
    with pytest.raises(EnvVarError, match=r"S='fork': use one of \['forkserver', 'spawn'\]"):
        env_vars.choice("S", ("forkserver", "spawn"), "forkserver", {"S": "fork"})
    assert env_vars.power_of_two("B", 16, {"B": "64"}) == 64 and env_vars.power_of_two("B", 16, {}) is None
    for raw in ("abc", "8", "48", "-16"):
        with pytest.raises(EnvVarError, match=rf"B='{raw}': use a power of two >= 16"):
            env_vars.power_of_two("B", 16, {"B": raw})


def test_the_kernels_read_the_variables_strictly(monkeypatch):
    from megatron_kl.vocab_parallel import triton_stats

    monkeypatch.setenv("MEGATRON_KL_TRITON", "off")
    assert triton_stats.enabled(torch.zeros(1)) is False
    monkeypatch.setenv("MEGATRON_KL_TRITON", "abc")
    with pytest.raises(EnvVarError, match="MEGATRON_KL_TRITON='abc'"):
        triton_stats.enabled(torch.zeros(1))
    monkeypatch.setenv("MEGATRON_KL_TRITON_BLOCK", "abc")
    with pytest.raises(EnvVarError, match="MEGATRON_KL_TRITON_BLOCK='abc'"):
        triton_stats._block(100)


@pytest.mark.parametrize(
    "name, raw",
    [
        ("MEGATRON_KL_TRITON", "-1"),
        ("MEGATRON_KL_TRITON_BLOCK", "abc"),
        ("MEGATRON_KL_NATIVE", "maybe"),
        ("MEGATRON_KL_RANKS_START", "fork"),
    ],
)
def test_check_refuses_a_bad_variable_naming_it(tmp_path, name, raw):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "train",
            "--config",
            "configs/cpu/default.yaml",
            "--check",
            f"train.output_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, name: raw},
        timeout=300,
    )
    assert done.returncode == 2 and f"environment variable {name}={raw!r}" in done.stderr, done.stderr[-2000:]
