"""`megatron-kl` command line: one subcommand per job (audit, train, study, convert, launch, config, validate).

Each subcommand's parser and code live in its own module (``COMMANDS``), imported only when that subcommand runs:
``megatron-kl --help`` and a config error never import torch or megatron-core they do not need."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from megatron_kl.cli_help import Parser, help_when_bare, quiet_optional_dependencies
from megatron_kl.redaction import redacted_output

# name -> (the module whose main(argv) runs it, its one-line help)
COMMANDS = {
    "train": ("megatron_kl.train.cli", "RL training (torchrun for several ranks)"),
    "study": ("megatron_kl.study.cli", "run a grid of KL configurations x seeds and write the report"),
    "audit": (
        "megatron_kl.kl.audit.cli",
        "exact gradient audit of every KL configuration (tabular policy); --dynamics: their exact training dynamics",
    ),
    "config": (
        "megatron_kl.config_reference",
        "every configuration field with its type, default, value and description (config show)",
    ),
    "launch": ("megatron_kl.launch.cli", "NeMo-Run: local torchrun or Slurm; status and logs of an experiment"),
    "convert": ("megatron_kl.models.convert", "HF <-> Megatron checkpoints"),
    "validate": ("megatron_kl.launch.node_check", "one-command node check"),
}


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="megatron-kl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=version(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, summary) in COMMANDS.items():  # each command parses its own arguments (megatron-kl NAME --help)
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def version() -> str:
    """``megatron-kl <package version>`` and the git commit of the source when it is a checkout."""
    try:
        number = metadata.version("megatron-kl")
    except metadata.PackageNotFoundError:
        number = "unknown"
    text = f"megatron-kl {number}"

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{text} (commit {commit})" if commit else text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_optional_dependencies()
    if argv and argv[0] in COMMANDS:  # the command's own parser takes the rest (its --help included)
        with redacted_output():  # no secret reaches the terminal or a job's log (megatron_kl/redaction.py)
            return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    parser = _parser()
    if help_when_bare(parser, argv):
        return 0
    parser.parse_args(argv)  # -h, or an unknown command: argparse's message and exit code
    return 2


if __name__ == "__main__":
    sys.exit(main())
