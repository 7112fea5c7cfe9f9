"""A verifier service for tests and examples: the protocol of the ``service`` reward (``POST /score`` with
``{"samples": [...]}``, answered ``{"rewards": [{"reward": r, "metrics": {...}}, ...]}``; ``GET /health``), scoring a
response 1 when it equals the sample's answer after trimming whitespace, with ``metrics.length`` (its characters).

    python -m megatron_kl.testing.reward_server --port 8100 [--token-env NAME] [faults]

``--token-env NAME``: requests need ``Authorization: Bearer <the value of $NAME>`` (401 otherwise; /health exempt).
Failure injection, each counted over /score requests:

    --fault-500-every N        every N-th request answers HTTP 500
    --fault-slow-every N       every N-th request sleeps --fault-delay-s before answering (client timeouts)
    --fault-malformed-every N  every N-th request answers a body that is not JSON
    --fault-count-every N      every N-th request answers one reward fewer than it was sent samples
    --fault-drop-every N       every N-th request closes the connection without an answer
    --fault-nan-every N        every N-th request answers NaN as its first reward (a well-formed, impossible value)
    --fault-first N            only the first N requests are eligible for the faults above (then all answer well)
    --fault-after N            only requests after the N-th are eligible (a service that breaks mid-run)

``RewardServer`` runs the same in a thread of the calling process (unit tests).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

FAULTS = ("500", "slow", "malformed", "count", "drop", "nan")


def score(sample: dict) -> dict:
    response = str(sample.get("response", ""))
    return {
        "reward": float(response.strip() == str(sample.get("answer", "")).strip()),
        "metrics": {"length": float(len(response))},
    }


class RewardServer:
    """The service on ``127.0.0.1:<port>`` in a background thread; ``faults``: ``{"500": N, "slow": N, ...}``."""

    def __init__(
        self,
        port: int = 0,
        token: Optional[str] = None,
        faults: Optional[dict] = None,
        delay_s: float = 2.0,
        first: Optional[int] = None,
        after: int = 0,
    ):
        unknown = set(faults or {}) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; use {FAULTS}")
        self.token, self.faults, self.delay_s, self.first, self.after = token, dict(faults or {}), delay_s, first, after
        self.requests = 0
        self.seen_headers: list[dict] = []
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "RewardServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which an unstarted server never runs
            self.httpd.shutdown()
        self.httpd.server_close()

    def fault_for(self, number: int) -> Optional[str]:
        if (self.first is not None and number > self.first) or number <= self.after:
            return None
        return next((kind for kind in FAULTS if self.faults.get(kind) and number % self.faults[kind] == 0), None)


def _handler(server: RewardServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"{}")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self):
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            if self.path != "/score":
                self._send(404, b'{"error": "not found"}')
                return
            with server._lock:
                server.requests += 1
                number = server.requests
                server.seen_headers.append(dict(self.headers))
            if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                self._send(401, b'{"error": "unauthorized"}')
                return
            try:
                samples = json.loads(raw)["samples"]
            except (ValueError, KeyError, TypeError):
                self._send(400, b'{"error": "expected {\\"samples\\": [...]}"}')
                return
            fault = server.fault_for(number)
            if fault == "500":
                self._send(500, b'{"error": "injected failure"}')
                return
            if fault == "drop":
                self.close_connection = True
                self.connection.close()
                return
            if fault == "slow":
                time.sleep(server.delay_s)
            if fault == "malformed":
                self._send(200, b'{"rewards": [1.0, ')
                return
            rewards = [score(s) for s in samples]
            if fault == "count":
                rewards = rewards[:-1]
            if fault == "nan" and rewards:
                rewards[0] = {"reward": float("nan"), "metrics": {}}
            self._send(200, json.dumps({"rewards": rewards}).encode())

    return Handler


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m megatron_kl.testing.reward_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8100, help="port to listen on")
    p.add_argument("--token-env", default="", help="require this environment variable's value as the bearer token")
    for kind in FAULTS:
        p.add_argument(
            f"--fault-{kind}-every", type=int, default=0, metavar="N", help=f"inject '{kind}' every N-th request"
        )
    p.add_argument("--fault-delay-s", type=float, default=2.0, help="the sleep of a 'slow' request")
    p.add_argument("--fault-first", type=int, default=None, metavar="N", help="faults only in the first N requests")
    p.add_argument("--fault-after", type=int, default=0, metavar="N", help="faults only after the N-th request")
    args = p.parse_args(argv)
    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        p.error(f"--token-env {args.token_env}: that environment variable is not set")
    faults = {kind: getattr(args, f"fault_{kind}_every") for kind in FAULTS if getattr(args, f"fault_{kind}_every")}
    server = RewardServer(args.port, token, faults, args.fault_delay_s, args.fault_first, args.fault_after)
    server.httpd.server_close()
    server.httpd = ThreadingHTTPServer((args.host, args.port), _handler(server))
    server.httpd.daemon_threads = True
    print(f"reward server on http://{args.host}:{args.port}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
