"""JSON-over-HTTP calls to a serving engine with retries.

Retried with exponential backoff: 5xx and 429 answers (429's ``Retry-After`` is honoured up to the
backoff cap), timeouts, refused or dropped connections, bodies cut short or not JSON, and bodies whose
values cannot be right (``CorruptResponse`` from the caller's ``parse``: NaN log-probs, token ids outside
the vocabulary, ...). Errors at once: other 4xx answers and bodies without the expected fields (retrying
cannot fix them). ``RetryPolicy.timeout_s`` is a total deadline per attempt - headers and body - not a
per-read timeout: a server that trickles bytes is cut off at the deadline. ``RetryPolicy.budget_s`` bounds
a whole call (every attempt and backoff); the trainer checks it is below the distributed timeout, so a
dead server ends in a clear error here, not in a collective that times out elsewhere.

Cancellation: :func:`cancel_requests` (called by the trainer's stop-signal handler) makes every call in
flight and every later one raise :class:`Cancelled` within moments: the sockets of the connections that
sessions from :func:`new_session` (and the default session) hold are shut down, backoff waits end, and
no new attempt starts until :func:`clear_cancel`. A hung server therefore never holds a stopping trainer
for the retry budget. Only the standard library, ``requests`` and its ``urllib3``."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A server answered with a client error, or a malformed body: not retried."""


class ServerUnavailable(RuntimeError):
    """Retries exhausted (5xx, timeouts, refused or dropped connections): the server may be dead."""


class CorruptResponse(RuntimeError):
    """A well-formed body with values that cannot be right (names the field and the server): retried like a
    5xx, then ServerUnavailable."""


class Cancelled(RuntimeError):
    """The trainer is stopping (a stop signal): calls in flight were cut off and no new one starts."""


_CANCEL = threading.Event()
_CANCEL_REASON = ["stopping"]
_OPEN: "weakref.WeakSet" = weakref.WeakSet()  # connections of tracked sessions with a socket


def _tracked(base):
    class Tracked(base):
        def connect(self):
            super().connect()
            _OPEN.add(self)

    return Tracked


class _TrackedPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _tracked(urllib3.connection.HTTPConnection)


class _TrackedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _tracked(urllib3.connection.HTTPSConnection)


class TrackingAdapter(HTTPAdapter):
    """An HTTPAdapter whose connections :func:`cancel_requests` can cut."""

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _TrackedPool, "https": _TrackedHTTPSPool}


def is_loopback(url: str) -> bool:
    """Whether ``url`` names this host's loopback (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerSession(requests.Session):
    """A session to rollout servers: a server on this host's loopback is reached directly whatever the environment's
    ``http_proxy`` says (a proxy would reach its own loopback, not this host's; ``requests`` proxies 127.0.0.1 unless
    ``no_proxy`` names it). Other hosts follow ``http_proxy`` / ``no_proxy``; the Slurm launcher adds a job's server
    nodes to ``no_proxy``."""

    def merge_environment_settings(self, url, proxies, stream, verify, cert):
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if is_loopback(url):
            settings["proxies"] = {}
        return settings


def new_session(pool_maxsize: int = 10, headers: Optional[dict] = None) -> requests.Session:
    session = ServerSession()  # keep-alive connections, as many as requests in flight
    session.headers.update(headers or {})
    adapter = TrackingAdapter(pool_connections=1, pool_maxsize=pool_maxsize)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


_DEFAULT_SESSION: list = []


def _default_session() -> requests.Session:
    if not _DEFAULT_SESSION:
        _DEFAULT_SESSION.append(new_session())
    return _DEFAULT_SESSION[0]


def cancel_requests(reason: str) -> None:
    """Cut every tracked connection and refuse new attempts (safe to call from a signal handler)."""
    _CANCEL_REASON[0] = reason
    _CANCEL.set()
    for _ in range(3):  # the set may change under us (another thread connecting)
        try:
            connections = list(_OPEN)
            break
        except RuntimeError:
            connections = []
    for connection in connections:
        sock = getattr(connection, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def clear_cancel() -> None:
    _CANCEL.clear()


def check_cancelled() -> None:
    if _CANCEL.is_set():
        raise Cancelled(_CANCEL_REASON[0])


@dataclass
class RetryPolicy:
    max_retries: int = 4
    backoff_s: float = 0.5
    timeout_s: float = 600.0  # total per attempt (headers + body)
    max_backoff_s: float = 30.0

    @property
    def budget_s(self) -> float:
        """Longest a call can take: every attempt at its deadline plus the backoffs between them."""
        waits = sum(min(self.max_backoff_s, self.backoff_s * 2**i) for i in range(self.max_retries))
        return (self.max_retries + 1) * self.timeout_s + waits


class _Deadline:
    """Shuts the response's socket down when the attempt's deadline passes: a blocked body read then fails
    at once instead of waiting for bytes that trickle in slower than the per-read timeout."""

    def __init__(self, seconds: float):
        self.expired = False
        self._response = None
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True

    def watch(self, response) -> None:
        self._response = response
        self._timer.start()

    def _fire(self) -> None:
        self.expired = True
        sock = _socket_of(self._response)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()


def _socket_of(response) -> Optional[socket.socket]:
    """The socket a streamed ``requests`` response reads from (urllib3 1.x and 2.x)."""
    raw = getattr(response, "raw", None)
    connection = getattr(raw, "connection", None) or getattr(raw, "_connection", None)
    sock = getattr(connection, "sock", None)
    if sock is None:  # http.client dropped its reference once the response began: the body's file holds it
        reader = getattr(getattr(raw, "_fp", None), "fp", None)
        sock = getattr(getattr(reader, "raw", None), "_sock", None)
    return sock


def _attempt(http, method: str, url: str, payload, timeout_s: float):
    """One request with a total deadline: (status, body bytes, text) or raises requests/timeout errors."""
    start = time.monotonic()
    response = http.request(method, url, json=payload, timeout=timeout_s, stream=True)
    deadline = _Deadline(timeout_s - (time.monotonic() - start))
    deadline.watch(response)
    try:
        content = response.content  # reads the whole body (Content-Length checked by urllib3)
    except (requests.RequestException, OSError) as err:
        if deadline.expired:
            raise requests.Timeout(f"no complete answer within {timeout_s:.0f}s (total deadline)") from err
        raise
    finally:
        deadline.cancel()
        response.close()
    if deadline.expired:
        raise requests.Timeout(f"no complete answer within {timeout_s:.0f}s (total deadline)")
    return response, content


def call(
    url: str,
    path: str,
    payload: Optional[dict] = None,
    policy: RetryPolicy = RetryPolicy(),
    method: str = "POST",
    session: Optional[requests.Session] = None,
    counters: Optional[dict] = None,
    parse: Optional[Callable[[Any], Any]] = None,
    auth_hint: Optional[str] = None,
) -> Any:
    """``method url+path`` with JSON ``payload``; returns the decoded JSON body (None for an empty body), or
    ``parse(body)`` when given (a ``CorruptResponse`` from it is retried). ``auth_hint``: what a 401 / 403 answer's
    error says to do (default: the SGLang API key's environment variable)."""
    http = session or _default_session()
    delay = policy.backoff_s
    last: Exception | None = None
    for attempt in range(policy.max_retries + 1):
        wait = delay
        check_cancelled()
        try:
            response, content = _attempt(http, method, url.rstrip("/") + path, payload, policy.timeout_s)
        except requests.RequestException as err:  # refused, dropped, timed out, cut short
            check_cancelled()  # cut off by cancel_requests, not by the server
            last = err
        else:
            if response.status_code >= 500 or response.status_code == 429:
                last = ServerUnavailable(f"{url}{path} answered {response.status_code}: {response.text[:200]}")
                retry_after = response.headers.get("Retry-After", "")
                if response.status_code == 429 and retry_after.replace(".", "", 1).isdigit():
                    wait = max(wait, float(retry_after))
            elif response.status_code in (401, 403):
                raise ServerError(
                    f"{url}{path} answered {response.status_code} ({response.text[:200]}): the server "
                    "refused the trainer's API key. "
                    + (
                        auth_hint
                        or "The trainer sends the key in the environment "
                        "variable named by rollout.sglang.api_key_env (default MEGATRON_KL_SGLANG_API_KEY): "
                        "set it to the key the server was started with (--api-key)"
                    )
                )
            elif response.status_code >= 400:
                raise ServerError(f"{url}{path} answered {response.status_code}: {response.text[:500]}")
            else:
                body = None
                try:
                    body = response.json() if content else None
                except ValueError:  # a body cut short, or not the server's JSON: retried
                    last = CorruptResponse(
                        f"{url}{path} answered a body that is not JSON ({len(content)} bytes): {content[:200]!r}"
                    )
                else:
                    if parse is None:
                        return body
                    try:
                        return parse(body)
                    except CorruptResponse as err:
                        last = err
        if counters is not None:
            counters["retries"] = counters.get("retries", 0) + 1
        if attempt < policy.max_retries:
            wait = min(wait, policy.max_backoff_s)
            log.warning(
                "%s%s failed (%s); retry %d/%d in %.1fs", url, path, last, attempt + 1, policy.max_retries, wait
            )
            _CANCEL.wait(wait)
            delay *= 2
    raise ServerUnavailable(f"{url}{path}: {policy.max_retries + 1} attempts failed, last: {last}")


def wait_healthy(url: str, timeout_s: float, alive=lambda: True, path: str = "/health") -> None:
    """Poll ``GET url/health`` until it answers 200; ``alive()`` false (the process died) fails at once."""
    deadline = time.monotonic() + timeout_s
    with ServerSession() as probe:
        while True:  # asked at least once, even with no time left
            check_cancelled()
            if not alive():
                raise ServerUnavailable(f"{url}: the server process exited while starting")
            try:
                if probe.get(url.rstrip("/") + path, timeout=5).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):
                pass
            if time.monotonic() >= deadline:
                break
            _CANCEL.wait(0.5)
    raise ServerUnavailable(f"{url}{path} not healthy after {timeout_s:.0f}s")
