"""A site's HTTP proxy for tests: it answers 502 to every request and records the URL of each, so a test can put it
in ``http_proxy`` and show which requests went through it (a request proxied over plain HTTP names the whole URL)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class SiteProxy:
    """Listening on ``127.0.0.1:port`` (0: any free port) until :meth:`close`; ``seen`` holds the proxied URLs."""

    def __init__(self, port: int = 0):
        self.seen: list[str] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append(self.path)
                self.send_response(502)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def environment(self) -> dict:
        """The environment of a process whose HTTP goes through this proxy, with no exceptions."""
        return {
            "http_proxy": self.url,
            "HTTP_PROXY": self.url,
            "https_proxy": self.url,
            "HTTPS_PROXY": self.url,
            "no_proxy": "",
            "NO_PROXY": "",
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
