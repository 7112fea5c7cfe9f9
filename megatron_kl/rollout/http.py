"""JSON-over-HTTP calls to a serving engine with retries: 5xx answers, timeouts, dropped connections and
bodies whose values cannot be right (``CorruptResponse`` from the caller's ``parse``: NaN log-probs,
token ids outside the vocabulary, ...) are retried with exponential backoff; 4xx answers and bodies without
the expected fields are errors at once (retrying cannot fix them). Only the standard library and
``requests``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import requests

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A server answered with a client error, or a malformed body: not retried."""


class ServerUnavailable(RuntimeError):
    """Retries exhausted (5xx, timeouts, refused or dropped connections): the server may be dead."""


class CorruptResponse(RuntimeError):
    """A well-formed body with values that cannot be right (names the field and the server): retried like a
    5xx, then ServerUnavailable."""


@dataclass
class RetryPolicy:
    max_retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0


def call(url: str, path: str, payload: Optional[dict] = None, policy: RetryPolicy = RetryPolicy(),
         method: str = "POST", session: Optional[requests.Session] = None, counters: Optional[dict] = None,
         parse: Optional[Callable[[Any], Any]] = None) -> Any:
    """``method url+path`` with JSON ``payload``; returns the decoded JSON body (None for an empty body), or
    ``parse(body)`` when given (a ``CorruptResponse`` from it is retried)."""
    http = session or requests
    delay = policy.backoff_s
    last: Exception | None = None
    for attempt in range(policy.max_retries + 1):
        try:
            response = http.request(method, url.rstrip("/") + path, json=payload, timeout=policy.timeout_s)
        except (requests.ConnectionError, requests.Timeout) as err:  # refused, dropped, timed out
            last = err
        else:
            if response.status_code >= 500:
                last = ServerUnavailable(f"{url}{path} answered {response.status_code}: {response.text[:200]}")
            elif response.status_code >= 400:
                raise ServerError(f"{url}{path} answered {response.status_code}: {response.text[:500]}")
            else:
                body = None
                if response.content:
                    try:
                        body = response.json()
                    except ValueError:
                        raise ServerError(f"{url}{path} answered a body that is not JSON: "
                                          f"{response.text[:200]!r}") from None
                if parse is None:
                    return body
                try:
                    return parse(body)
                except CorruptResponse as err:
                    last = err
        if counters is not None:
            counters["retries"] = counters.get("retries", 0) + 1
        if attempt < policy.max_retries:
            log.warning("%s%s failed (%s); retry %d/%d in %.1fs", url, path, last, attempt + 1, policy.max_retries,
                        delay)
            time.sleep(delay)
            delay *= 2
    raise ServerUnavailable(f"{url}{path}: {policy.max_retries + 1} attempts failed, last: {last}")


def wait_healthy(url: str, timeout_s: float, alive=lambda: True, path: str = "/health") -> None:
    """Poll ``GET url/health`` until it answers 200; ``alive()`` false (the process died) fails at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise ServerUnavailable(f"{url}: the server process exited while starting")
        try:
            if requests.get(url.rstrip("/") + path, timeout=5).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):
            pass
        time.sleep(0.5)
    raise ServerUnavailable(f"{url}{path} not healthy after {timeout_s:.0f}s")
