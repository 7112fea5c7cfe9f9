"""The `megatron-kl` command tree: every command answers --help with its own usage, a command with sub-actions
called alone prints its help, an unknown command is argparse's error, and a config error is reported without
importing torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kl.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.fast
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: megatron-kl {command} ")


@pytest.mark.fast
@pytest.mark.parametrize("argv, usage", [([], "usage: megatron-kl [-h] COMMAND"),
                                         (["config"], "usage: megatron-kl config [-h] ACTION"),
                                         (["launch"], "usage: megatron-kl launch [-h]")])
def test_a_bare_command_prints_its_help(argv, usage, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(usage), out
    if not argv:  # the top level lists every command with its summary
        assert all(name in out for name in COMMANDS)


@pytest.mark.fast
def test_an_unknown_command_is_an_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as done:
        main(["trian"])
    assert done.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


@pytest.mark.fast
@pytest.mark.parametrize("override", ["rollout.engine=embedded", "kl.estimator=k4", "optim.adam_kernel=apex",
                                      "algo.behavior_correction=nope", "rollout.sampling.top_p=2"])
def test_a_config_error_is_reported_before_torch_is_imported(override):
    """Loading and validating a configuration needs the config dataclasses only (kl/config.py, algo/config.py,
    models/optim_config.py, rollout/config.py): a mistyped value is reported in a fraction of a second, not after
    torch and megatron-core have loaded."""
    probe = ("import sys\nfrom megatron_kl.cli import main\n"
             f"code = main(['train', '--config', 'configs/cpu/default.yaml', {override!r}])\n"
             "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n"
             "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "config error" in done.stderr and override.split("=")[0] in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
