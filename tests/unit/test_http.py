"""The HTTP client's failure semantics against a local server that misbehaves on purpose: a body trickled
byte by byte (total deadline per attempt, not per read), a body cut short, 429 with Retry-After, and the
retry budget that the trainer compares with the distributed timeout; a site's HTTP proxy in the environment, which a
server on this host's loopback must not go through."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_kl.rollout.http import RetryPolicy, ServerError, ServerUnavailable, call


class _Server:
    def __init__(self, script):
        self.script, self.hits = list(script), 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                mode = outer.script[min(outer.hits, len(outer.script) - 1)]
                outer.hits += 1
                body = json.dumps({"ok": True, "hit": outer.hits}).encode()
                if mode == "ok":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif mode == "trickle":  # one byte every 0.2 s: each read is quick, the whole is not
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    try:
                        for byte in body:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            time.sleep(0.2)
                    except OSError:
                        pass
                elif mode == "truncated":  # promises more than it sends, then closes
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body) + 50))
                    self.end_headers()
                    self.wfile.write(body[:5])
                    self.close_connection = True
                elif mode == "429":
                    self.send_response(429)
                    self.send_header("Retry-After", "0.2")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                elif mode == "400":
                    self.send_response(400)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")

            def do_GET(self):  # /health
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def server(request):
    made = []

    def make(*script):
        made.append(_Server(script))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_trickling_body_is_cut_at_the_total_deadline(server):
    s = server("trickle")
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match="total deadline"):
        call(s.url, "/generate", {}, RetryPolicy(max_retries=1, backoff_s=0.0, timeout_s=1.0))
    assert time.monotonic() - start < 4.0 and s.hits == 2  # two attempts of ~1 s, not 2 x 4 s of trickle


def test_a_body_cut_short_and_429_are_retried(server):
    s = server("truncated", "429", "ok")
    assert call(s.url, "/generate", {}, RetryPolicy(max_retries=3, backoff_s=0.01, timeout_s=5.0))["hit"] == 3


def test_other_4xx_is_an_error_at_once(server):
    s = server("400", "ok")
    with pytest.raises(ServerError, match="400"):
        call(s.url, "/generate", {}, RetryPolicy(max_retries=3, backoff_s=0.01))
    assert s.hits == 1


def test_retry_budget_counts_every_attempt_and_backoff():
    policy = RetryPolicy(max_retries=3, backoff_s=1.0, timeout_s=10.0, max_backoff_s=3.0)
    assert policy.budget_s == 4 * 10.0 + (1.0 + 2.0 + 3.0)


@pytest.fixture
def site_proxy(monkeypatch):
    """A site's HTTP proxy in the environment, with nothing in no_proxy."""
    from megatron_kl.testing.site_proxy import SiteProxy

    proxy = SiteProxy()
    for name, value in proxy.environment().items():
        monkeypatch.setenv(name, value)
    yield proxy
    proxy.close()


def test_a_server_on_loopback_is_reached_directly_whatever_the_proxy_says(server, site_proxy):
    from megatron_kl.rollout.http import new_session, wait_healthy

    s = server("ok")
    assert call(s.url, "/generate", {}, RetryPolicy(max_retries=0))["hit"] == 1  # the default session
    assert (
        call(
            s.url.replace("127.0.0.1", "localhost"), "/generate", {}, RetryPolicy(max_retries=0), session=new_session()
        )["hit"]
        == 2
    )
    wait_healthy(s.url, timeout_s=5.0)  # the start-up probe too
    assert site_proxy.seen == []


def test_another_host_still_goes_through_the_proxy(site_proxy):
    from megatron_kl.rollout.http import is_loopback

    with pytest.raises(ServerUnavailable, match="502"):  # the proxy's answer: the environment is honoured
        call("http://rollout-node.invalid:30000", "/generate", {}, RetryPolicy(max_retries=0, timeout_s=5.0))
    assert site_proxy.seen == ["http://rollout-node.invalid:30000/generate"]
    assert [
        is_loopback(u)
        for u in ("http://127.0.0.2:1", "http://[::1]:1", "http://a.localhost", "http://node1:1", "http://10.0.0.1:1")
    ] == [True, True, True, False, False]
