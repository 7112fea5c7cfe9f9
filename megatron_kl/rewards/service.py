"""The ``service`` reward: a verifier or reward-model service over HTTP (protocol: ``config.RewardServiceConfig``).

A step's samples are split into requests of ``batch_size``, sent ``concurrency`` at a time to the configured URLs in
turn, each through :func:`megatron_kl.rollout.http.call` (retries with exponential backoff on 5xx / 429, timeouts,
dropped connections, bodies that are not JSON; a body with the wrong count of rewards is retried too). The bearer
token is read from the environment variable ``token_env`` once, kept in the session's headers only, and never
logged; the config names the variable, not the token.
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import requests

from megatron_kl.config import ConfigError
from megatron_kl.redaction import register
from megatron_kl.rewards.config import RewardServiceConfig
from megatron_kl.rewards.types import RewardInput
from megatron_kl.rollout import http


class RewardService:
    """A batch reward function: ``service(samples) -> list`` of one raw result per sample (a number or a
    ``{"reward", "metrics"}`` mapping, checked by the scorer)."""

    def __init__(self, cfg: RewardServiceConfig, environ: Optional[dict] = None):
        if not cfg.urls:
            raise ConfigError(
                "reward.service.urls is empty: give the verifier's address, e.g. "
                "reward.service.urls=[http://verifier:8000]"
            )
        bad = [u for u in cfg.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"reward.service.urls {bad}: each must start with http:// or https://")
        headers = {}
        if cfg.token_env:
            token = (environ if environ is not None else os.environ).get(cfg.token_env, "")
            if not token:
                raise ConfigError(
                    f"reward.service.token_env={cfg.token_env}: that environment variable is not set (or "
                    "empty); export the service's token in it, or set reward.service.token_env='' for "
                    "a service without authentication"
                )
            register(token)  # a token_env of any name: redacted from every line written from now on
            headers["Authorization"] = f"Bearer {token}"
        self.cfg = cfg
        self.policy = http.RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.timeout_s)
        self.session = http.new_session(pool_maxsize=cfg.concurrency, headers=headers)
        self._urls = itertools.cycle(cfg.urls)
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="reward-service")
        self.counters: dict = {}
        self._reachable = cfg.startup_timeout_s == 0

    def wait_reachable(self) -> None:
        """Every URL answers something (``GET /health``, any status) within ``startup_timeout_s``, else
        ``ServerUnavailable`` naming the ones that do not."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = list(self.cfg.urls)
        while waiting:
            http.check_cancelled()
            for url in list(waiting):
                try:
                    self.session.get(url.rstrip("/") + "/health", timeout=5).close()
                    waiting.remove(url)
                except (requests.ConnectionError, requests.Timeout):
                    pass
            if waiting and time.monotonic() >= deadline:
                raise http.ServerUnavailable(
                    f"reward service {waiting} not reachable after "
                    f"reward.service.startup_timeout_s={self.cfg.startup_timeout_s:g}s"
                )
            if waiting:
                time.sleep(0.5)
        self._reachable = True

    def __call__(self, samples: list[RewardInput]) -> list[Any]:
        if not self._reachable:
            self.wait_reachable()
        size = self.cfg.batch_size
        chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
        futures = [self._pool.submit(self._request, next(self._urls), chunk) for chunk in chunks]
        return [value for future in futures for value in future.result()]

    def _request(self, url: str, chunk: list[RewardInput]) -> list[Any]:
        def parse(body):
            rewards = body.get("rewards") if isinstance(body, dict) else None
            if not isinstance(rewards, list):
                raise http.CorruptResponse(
                    f"{url}{self.cfg.path} answered without a list 'rewards' ({str(body)[:120]})"
                )
            if len(rewards) != len(chunk):
                raise http.CorruptResponse(
                    f"{url}{self.cfg.path} answered {len(rewards)} rewards for {len(chunk)} samples"
                )
            return rewards

        return http.call(
            url,
            self.cfg.path,
            {"samples": [s.to_json() for s in chunk]},
            self.policy,
            session=self.session,
            counters=self.counters,
            parse=parse,
            auth_hint=f"The trainer sends the token in the environment variable reward.service.token_env="
            f"{self.cfg.token_env or '(none set)'}: set it to the service's token",
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.session.close()
