"""The `megatron-kl` command tree: every command answers --help with its own usage, a command with sub-actions
called alone prints its help, an unknown command is argparse's error, and a config error is reported without
importing megatron-core."""

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
def test_a_config_error_is_reported_before_megatron_core_is_imported():
    probe = ("import sys\nfrom megatron_kl.cli import main\n"
             "code = main(['train', '--config', 'configs/cpu/default.yaml', 'rollout.engine=embedded'])\n"
             "print('megatron-core imported' if 'megatron.core' in sys.modules else 'megatron-core not imported')\n"
             "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rollout.engine='embedded'" in done.stderr and "rollout.engine" in done.stderr.splitlines()[-1]
    assert done.stdout.strip() == "megatron-core not imported"
