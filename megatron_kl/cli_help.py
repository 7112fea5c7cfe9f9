"""What every ``megatron-kl`` command with sub-actions shares: called alone, it prints its help."""

from __future__ import annotations

import argparse
import logging
import os
import warnings


def help_when_bare(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """A command with sub-actions called alone (``megatron-kl config``): print its help; True when it did."""
    if argv:
        return False
    parser.print_help()
    return True


def plain(text: str | None) -> str | None:
    """A docstring as help text: reStructuredText's ``literal`` quoting dropped (help is read in a terminal)."""
    return None if text is None else text.replace("``", "")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose description and help read as plain text, and whose "unrecognized arguments" error
    says how overrides are written."""

    def __init__(self, *args, **kwargs):
        kwargs["description"] = plain(kwargs.get("description"))
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if "help" in kwargs:
            kwargs["help"] = plain(kwargs["help"])
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        if "unrecognized arguments" in message:
            message += (
                "\n  configuration overrides are written section.key=value (e.g. kl.coef=0.1), also accepted as "
                "--section.key=value or --section.key value"
            )
        super().error(message)


def normalize_overrides(argv: list[str], known: tuple[str, ...] = ()) -> list[str]:
    """``--kl.coef=0.1`` and ``--kl.coef 0.1`` (the habit of TRL and HF users) as the override ``kl.coef=0.1``; an
    option that is not dotted, or one of ``known``, is left for argparse."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        name = word[2:].split("=", 1)[0]
        if word.startswith("--") and "." in name and word not in known and not name.startswith("."):
            if "=" in word:
                out.append(word[2:])
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out.append(f"{name}={argv[i + 1]}")
                i += 1
            else:
                out.append(word)  # no value: argparse names it
        else:
            out.append(word)
        i += 1
    return out


def quiet_optional_dependencies() -> None:
    """megatron-core warns at import, once per module, that Transformer Engine and Apex are not installed and it falls
    back to its local implementations: expected on a CPU and said once at debug level here instead. A feature that
    needs them (context parallelism's Transformer Engine attention, FP8 GEMMs) says so where it is asked for."""
    starts = ("Transformer Engine and Apex are not installed", "Apex is not installed")
    for start in starts:
        warnings.filterwarnings("ignore", message=start, category=UserWarning)
    # the ranks and workers this process starts (a fork server imports megatron-core afresh) inherit the rule
    rules = [r for r in os.environ.get("PYTHONWARNINGS", "").split(",") if r]
    rules += [f"ignore:{start}:UserWarning" for start in starts if f"ignore:{start}:UserWarning" not in rules]
    os.environ["PYTHONWARNINGS"] = ",".join(rules)
    logging.getLogger("megatron_kl").debug(
        "Transformer Engine / Apex not installed: megatron-core's local implementations are used"
    )
