"""What every ``megatron-kl`` command with sub-actions shares: called alone, it prints its help."""

from __future__ import annotations

import argparse


def help_when_bare(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """A command with sub-actions called alone (``megatron-kl config``): print its help; True when it did."""
    if argv:
        return False
    parser.print_help()
    return True
