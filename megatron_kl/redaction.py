"""One redaction rule for everything the project writes: command lines, configs and log lines.

A value is secret when it is

* the value of a command-line flag whose last word is a secret word (``--api-key K``, ``--hf-token=K``,
  ``--admin-api-key K``; ``--token-latency-s 0.2`` is not: its last word is ``s``);
* the value of a config field or mapping key whose last word is a secret word (``api_key``, ``hf_token``,
  ``password``; not ``token_dispatcher``, nor the ``*_env`` fields, which hold the *name* of a variable);
* the value of an environment variable whose name ends in a secret word (``HF_TOKEN``,
  ``WANDB_API_KEY``, ``MEGATRON_KL_SGLANG_API_KEY``; ``TOKENIZERS_PARALLELISM`` is not), at least
  ``MIN_CHARS`` long;
* registered at run time (:func:`register`: the managed servers' key);
* the password of a URL (``http://user:password@host``).

Secret words: key, apikey, token, secret, password, passwd, credential(s). :func:`redact_args`,
:func:`redact_config` and :func:`redact_text` replace them with ``<redacted>``; :func:`install_log_filter` puts
the rule on every handler of the root logger. This module imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import sys
import threading
from typing import Iterable, Mapping, Optional, Sequence

REDACTED = "<redacted>"
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"})
MIN_CHARS = 6  # shorter environment values ("1", "true") are not redacted from text: they would hide everything
_WORD = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")
_registered: set[str] = set()
_lock = threading.Lock()


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD.split(str(name)) if w]


def is_secret_name(name: str) -> bool:
    """A field, key or variable name that holds a secret: its last word is a secret word (``*_env`` names a variable,
    ``token_dispatcher`` a choice)."""
    words = _words(name)
    return bool(words) and words[-1] in SECRET_WORDS


def is_secret_flag(flag: str) -> bool:
    """A command-line flag whose value is a secret: its last word is a secret word."""
    if not flag.startswith("-"):
        return False
    words = _words(flag.split("=", 1)[0])
    return bool(words) and words[-1] in SECRET_WORDS


def secret_flag_values(args: Sequence[str]) -> list[str]:
    """The values given to secret flags in ``args`` (``--flag value`` and ``--flag=value``)."""
    values, args = [], [str(a) for a in args]
    for i, arg in enumerate(args):
        if not is_secret_flag(arg):
            continue
        if "=" in arg:
            values.append(arg.split("=", 1)[1])
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            values.append(args[i + 1])
    return [v for v in values if v]


def redact_args(args: Sequence[str]) -> list[str]:
    """``args`` with the secret flags' values replaced (a copy)."""
    out, args = [], [str(a) for a in args]
    hide_next = False
    for arg in args:
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if is_secret_flag(arg):
            if "=" in arg:
                arg = arg.split("=", 1)[0] + "=" + REDACTED
            else:
                hide_next = True
        out.append(redact_text(arg))
    return out


def register(*values: Optional[str]) -> None:
    """Secrets known at run time (a generated key): redacted from every text and log line from now on."""
    with _lock:
        _registered.update(v for v in values if v)


def register_config(data) -> None:
    """Register the secrets a config dict holds (secret fields, secret flags' values): a line that quotes one later
    (a reward function's print, an error echoing a value) is redacted too."""
    if isinstance(data, dict):
        for k, v in data.items():
            if is_secret_name(k) and isinstance(v, str):
                register(v)
            else:
                register_config(v)
    elif isinstance(data, (list, tuple)):
        if all(isinstance(v, str) for v in data):
            register(*secret_flag_values(data))
        else:
            for v in data:
                register_config(v)


def environment_secrets(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    environ = os.environ if environ is None else environ
    return [v for k, v in environ.items() if is_secret_name(k) and len(v) >= MIN_CHARS]


def _known(extra: Iterable[str]) -> list[str]:
    with _lock:
        known = set(_registered)
    known.update(v for v in extra if v)
    known.update(environment_secrets())
    return sorted(known, key=len, reverse=True)  # a longer secret first: one that contains another is hidden whole


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret (``secrets``, registered, the environment's) and URL passwords replaced."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", str(text))
    for secret in _known(secrets):
        text = text.replace(secret, REDACTED)
    return text


def redact_config(data, secrets: Iterable[str] = ()):
    """A copy of a config dict (``to_dict``) for files, trackers and printing: secret fields and mapping keys, the
    values of secret flags in every list of arguments, and every known secret inside any string, replaced."""
    known = list(secrets)

    def walk(node, name: str = ""):
        if isinstance(node, dict):
            return {
                k: (REDACTED if is_secret_name(k) and isinstance(v, str) and v else walk(v, str(k)))
                for k, v in node.items()
            }
        if isinstance(node, (list, tuple)):
            if all(isinstance(v, str) for v in node):
                return (
                    redact_args(node) if any(is_secret_flag(v) for v in node) else [redact_text(v, known) for v in node]
                )
            return [walk(v, name) for v in node]
        if isinstance(node, str):
            return redact_text(node, known)
        return node

    return walk(copy.deepcopy(data))


class RedactingFilter(logging.Filter):
    """Rewrites each record's message through :func:`redact_text` (arguments merged first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            if redact_text(text) != text:
                record.exc_text = redact_text(text)
        return True


def install_log_filter(logger: Optional[logging.Logger] = None) -> None:
    """Put :class:`RedactingFilter` on every handler of ``logger`` (the root logger): each line written is redacted."""
    logger = logging.getLogger() if logger is None else logger
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


class RedactingStream:
    """A text stream that writes through :func:`redact_text` (the command line's stdout and stderr: every print,
    log line and traceback of a command)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact_text(text))
        return len(text)

    def __getattr__(self, name):  # flush, isatty, fileno, encoding, ...: the wrapped stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def redacted_output():
    """stdout and stderr redacted for the duration (nested uses wrap once)."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout = RedactingStream(sys.stdout)
    if not isinstance(sys.stderr, RedactingStream):
        sys.stderr = RedactingStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
