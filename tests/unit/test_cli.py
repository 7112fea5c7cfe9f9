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
@pytest.mark.parametrize(
    "argv, usage",
    [
        ([], "usage: megatron-kl [-h] [--version] COMMAND"),
        (["config"], "usage: megatron-kl config [-h] ACTION"),
        (["launch"], "usage: megatron-kl launch [-h]"),
    ],
)
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
@pytest.mark.parametrize(
    "override",
    [
        "rollout.engine=embedded",
        "kl.estimator=k4",
        "optim.adam_kernel=apex",
        "algo.behavior_correction=nope",
        "rollout.sampling.top_p=2",
    ],
)
def test_a_config_error_is_reported_before_torch_is_imported(override):
    """Loading and validating a configuration needs the config dataclasses only (kl/config.py, algo/config.py,
    models/optim_config.py, rollout/config.py): a mistyped value is reported in a fraction of a second, not after
    torch and megatron-core have loaded."""
    probe = (
        "import sys\nfrom megatron_kl.cli import main\n"
        f"code = main(['train', '--config', 'configs/cpu/default.yaml', {override!r}])\n"
        "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n"
        "sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "config error" in done.stderr and override.split("=")[0] in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"megatron-kl {metadata.version('megatron-kl')}")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--kl.coef=0.1"], ["kl.coef=0.1"]),
        (["--kl.coef", "0.1", "--check"], ["kl.coef=0.1", "--check"]),
        (["--optim.lr", "-1", "x.y=2"], ["optim.lr=-1", "x.y=2"]),
        (["--config", "a.yaml", "--kl.coef"], ["--config", "a.yaml", "--kl.coef"]),  # no value: left for argparse
        (["--config", "my.config.yaml"], ["--config", "my.config.yaml"]),  # a value with dots is not an option
    ],
)
def test_dashed_overrides_become_dotted_ones(argv, expected):
    from megatron_kl.cli_help import normalize_overrides

    assert normalize_overrides(argv) == expected


def test_train_takes_dashed_overrides_and_hints_at_the_form(capsys):
    config = str(ROOT / "configs" / "cpu" / "default.yaml")
    assert main(["train", "--config", config, "--check", "--kl.coef=0.25", "--train.steps", "7"]) == 0
    out = capsys.readouterr().out
    assert "  coef: 0.25" in out and "  steps: 7" in out
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", config, "--kl_coef", "0.1"])
    assert done.value.code == 2
    assert "written section.key=value (e.g. kl.coef=0.1)" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_plain_help(command, capsys, monkeypatch):
    import argparse

    built = []
    original = argparse.ArgumentParser.parse_known_args

    def record(self, *args, **kwargs):
        built.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", record)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out, out
    parsers = list(built)
    assert parsers and parsers[0].prog.startswith(f"megatron-kl {command}")
    for parser in list(parsers):  # sub-actions' parsers too
        for action in parser._actions:
            if isinstance(action.choices, dict):
                parsers += list(action.choices.values())
    for parser in parsers:
        for action in parser._actions:
            if action.dest in ("command", "action") or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"
