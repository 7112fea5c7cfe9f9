"""What every ``megatron-kl`` command with sub-actions shares: called alone, it prints its help."""

from __future__ import annotations

import argparse


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
            message += ("\n  configuration overrides are written section.key=value (e.g. kl.coef=0.1), also accepted as "
                        "--section.key=value or --section.key value")
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
