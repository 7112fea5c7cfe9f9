"""SGLang rollout engine: managed ``sglang.launch_server`` processes or existing servers (or one sglang-router).

HTTP API subset used, with shapes from SGLang 0.5.x (``srt/managers/io_struct.py``: GenerateReqInput,
UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput, InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput, Release/ResumeMemoryOccupationReqInput, PauseGenerationReqInput;
routes in ``srt/entrypoints/http_server.py``):

- ``POST /generate``: the request and the checked response are in :mod:`megatron_kl.rollout.sglang_protocol`;
  with routing replay the servers start with ``--enable-return-routed-experts``.
- ``GET /health``, ``POST /flush_cache``, ``/pause_generation``, ``/continue_generation``,
  ``/release_memory_occupation``, ``/resume_memory_occupation``, and the weight-update routes used by
  :mod:`megatron_kl.rollout.sglang_sync`.

Every request goes to one server (round-robin), at most ``max_concurrency`` in flight. A server that stays
unavailable after the retries is restarted (managed servers) and its unfinished requests are re-issued;
each prompt's completion is kept once, so no sample is lost or duplicated. A response that does not have the
expected shape, or carries another weight version than the one last pushed, is an error naming the field.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import requests

from megatron_kl.redaction import register
from megatron_kl.rollout.config import SGLangConfig
from megatron_kl.rollout.engine import (
    PAUSED,
    Completion,
    SamplingConfig,
    checked_budgets,
)
from megatron_kl.rollout.http import (
    RetryPolicy,
    ServerError,
    ServerUnavailable,
    call,
    new_session,
    wait_healthy,
)
from megatron_kl.rollout.quantization import check_served_quantization
from megatron_kl.rollout.servers import ManagedServer, start_on_free_port
from megatron_kl.rollout.sglang_protocol import RoutingShape, parse_generate, sampling_params, top_logprobs_num

log = logging.getLogger(__name__)


def server_flags(
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    dp_size: int,
    mem_fraction_static: float,
    seed: int,
    routed_experts: bool = False,
    quantization: str = "none",
    weight_loaders: Sequence[str] = (),
    memory_saver: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``sglang.launch_server`` flags of a rollout server, the one place they are written: managed servers
    (:func:`server_command`) and the servers a Slurm job starts (``launch/jobs.py``) both take them from here.
    ``routed_experts``: routing replay (the servers report each token's experts); ``quantization``: FP8 rollouts;
    ``weight_loaders``: delta sync's loader (rollout/delta.py). The API key is not among them: each caller adds it
    its own way (a value here, an environment variable in a job script)."""
    flags = [
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--dp-size",
        str(dp_size),
        "--mem-fraction-static",
        str(mem_fraction_static),
        "--skip-tokenizer-init",
        "--random-seed",
        str(seed),
    ]
    if routed_experts:
        flags.append("--enable-return-routed-experts")
    if memory_saver:
        flags.append("--enable-memory-saver")
    if quantization != "none":
        flags += ["--quantization", quantization]
    if weight_loaders:
        flags += ["--custom-weight-loader", *weight_loaders]
    return flags + list(extra_args)


def server_command(
    cfg: SGLangConfig,
    model_path: str,
    port: int,
    seed: int,
    api_key: Optional[str] = None,
    routed_experts: bool = False,
    quantization: str = "none",
    weight_loaders: Sequence[str] = (),
) -> list[str]:
    """A managed server's command line (:func:`server_flags` with ``rollout.sglang``'s settings and the key)."""
    flags = server_flags(
        model_path,
        cfg.host,
        port,
        cfg.tp_size,
        cfg.dp_size,
        cfg.mem_fraction_static,
        seed,
        routed_experts,
        quantization,
        weight_loaders,
        cfg.enable_memory_saver,
    )
    return [
        sys.executable,
        "-m",
        cfg.server_module,
        *flags,
        *(["--api-key", api_key] if api_key else []),
        *cfg.extra_args,
    ]


def wait_for_servers(urls: Sequence[str], timeout_s: float) -> None:
    """Given servers (``rollout.sglang.urls``) may still be loading when the trainer starts (a Slurm het job
    starts both groups together): wait until every one answers ``GET /health``, all within one deadline."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        try:
            wait_healthy(url, max(0.0, deadline - time.monotonic()))
        except ServerUnavailable:
            raise ServerUnavailable(
                f"rollout.sglang.urls: {url} did not answer GET /health with 200 within rollout.sglang."
                f"startup_timeout_s={timeout_s:g}s; start that server (or fix the address) or raise the timeout"
            ) from None
        log.info("server %s is healthy", url)


class SGLangEngine:
    """The rollout-engine protocol over SGLang HTTP servers (used from one trainer process)."""

    def __init__(
        self,
        cfg: SGLangConfig,
        weight_sync,
        model_path: Optional[str] = None,
        log_dir="runs/sglang",
        seed: int = 0,
        vocab_size: Optional[int] = None,
        routing: Optional[RoutingShape] = None,
        quantization: str = "none",
        partial: bool = False,
    ):
        self.cfg = cfg
        self.vocab_size = vocab_size  # response ids are checked against it
        self.routing = routing  # mixture of experts with routing replay: every completion carries its routing
        self.sync = weight_sync
        self.policy = RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.request_timeout_s)
        self.weight_version = 0
        self.released = False  # colocated: memory handed back to the trainer
        self._paused = threading.Event()  # partial rollouts: no request goes out, those in flight come back cut
        self.counters = {"retries": 0, "restarts": 0, "reissued": 0}
        self._lock = threading.RLock()  # recover() runs inside update_weights()
        self.servers: list[Optional[ManagedServer]]
        # every request carries the servers' API key: /update_weights_from_tensor unpickles its input
        self.api_key = os.environ.get(cfg.api_key_env) or (None if cfg.urls else secrets.token_hex(16))
        register(self.api_key)
        if cfg.urls:
            self.urls = list(cfg.urls)
            self.servers = [None] * len(self.urls)
            wait_for_servers(self.urls, cfg.startup_timeout_s)
        else:
            if model_path is None:
                raise ValueError(
                    "rollout.sglang: managed servers need a model path (rollout.sglang.model_path, "
                    "init.hf_checkpoint, or the trainer's initial export)"
                )
            self.urls, self.servers = [], []
            next_port = cfg.port
            for index in range(cfg.num_servers):
                server = start_on_free_port(
                    f"sglang-{index}",
                    lambda port: server_command(
                        cfg,
                        model_path,
                        port,
                        seed,
                        self.api_key,
                        routed_experts=routing is not None,
                        quantization=quantization,
                        weight_loaders=weight_sync.loaders,
                    ),
                    cfg.host,
                    next_port,
                    log_dir,
                    cfg.startup_timeout_s,
                    secrets=(self.api_key,),
                )
                self.urls.append(server.url)
                self.servers.append(server)
                next_port = int(server.url.rsplit(":", 1)[1]) + 1
        self._sessions = [self._session(cfg.max_concurrency, self.api_key) for _ in self.urls]
        try:
            self._check_servers(partial, quantization)
        except BaseException:  # refused at start: the servers started here do not outlive the refusal
            self.shutdown()
            raise

    def _check_servers(self, partial: bool, quantization: str) -> None:
        """What the run needs from the servers, asked once they answer: the pause routes (rollout.partial) and, for
        given servers, the quantization they sample with."""
        cfg = self.cfg
        if partial:  # rollout.partial pauses them mid-generation: the routes must exist (harmless when not paused)
            for index, url in enumerate(self.urls):
                try:
                    self.call(index, "/continue_generation", {})
                except ServerError as err:
                    raise ValueError(
                        f"rollout.partial=true: {url} cannot pause and continue generation "
                        f"(/continue_generation: {err}); use an SGLang with /pause_generation or set "
                        "rollout.partial=false"
                    ) from err
        for index, url in enumerate(self.urls if cfg.urls else []):  # they sample with the weights the run declares
            try:
                info = self.call(index, "/get_server_info", method="GET")
            except ServerError as err:  # a router without the route, say: only an FP8 run needs the answer
                if quantization == "none":
                    log.warning("%s: /get_server_info failed (%s); its quantization is not checked", url, err)
                    continue
                raise ValueError(
                    f"rollout.quantization={quantization}: rollout.sglang.urls: {url} did not say which "
                    f"weights it serves (/get_server_info: {err}); give the servers' own addresses"
                ) from err
            check_served_quantization(
                info.get("quantization") if isinstance(info, dict) else None,
                quantization,
                f"rollout.sglang.urls: {url}",
            )

    @staticmethod
    def _session(pool: int, api_key: Optional[str] = None) -> requests.Session:
        """Keep-alive connections, as many as requests in flight; cut by a stop signal (rollout/http.py)."""
        return new_session(pool, {"Authorization": f"Bearer {api_key}"} if api_key else None)

    # -- HTTP ------------------------------------------------------------------------------------
    def call(self, index: int, path: str, payload: Optional[dict] = None, method: str = "POST", parse=None):
        return call(
            self.urls[index], path, payload, self.policy, method, self._sessions[index], self.counters, parse=parse
        )

    def broadcast(self, path: str, payload: Optional[dict] = None, recover: bool = False) -> list:
        """The same control call on every server (in parallel); ``recover``: a server that stays unavailable is
        restarted (back at the committed weights) and called again."""

        def one(i: int):
            try:
                return self.call(i, path, payload)
            except ServerUnavailable as err:
                if not recover:
                    raise
                return err

        with ThreadPoolExecutor(len(self.urls)) as pool:
            results = list(pool.map(one, range(len(self.urls))))
        for i, result in enumerate(results):  # in the caller's thread: update_weights holds the lock
            if isinstance(result, ServerUnavailable):
                self.recover(i)
                results[i] = self.call(i, path, payload)
        return results

    def recover(self, index: int, cause: Optional[Exception] = None) -> None:
        """Restart server ``index`` (managed servers) and bring it back to the last committed weights."""
        server = self.servers[index]
        if server is None or not self.cfg.restart_dead_servers:
            why = (
                "not managed here: restart it or remove it from rollout.sglang.urls"
                if server is None
                else "rollout.sglang.restart_dead_servers=false"
            )
            raise ServerUnavailable(
                f"SGLang server {self.urls[index]} is unavailable ({why})"
                + (f"; last error: {cause}" if cause is not None else "")
            )
        with self._lock:
            server.restart()
            self.counters["restarts"] += 1
            self.sync.after_restart(self, index)

    # -- generation ------------------------------------------------------------------------------
    def pause(self) -> None:
        """Partial rollouts: requests not yet sent are answered at once with nothing generated, and the servers
        abort those in flight (``/pause_generation`` mode abort), which come back with their partial output."""
        self._paused.set()
        self.broadcast("/pause_generation", {"mode": "abort"}, recover=True)

    def resume(self) -> None:
        self.broadcast("/continue_generation", {}, recover=True)
        self._paused.clear()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: Optional[int] = None,
        budgets: Optional[Sequence[int]] = None,
    ) -> list[Completion]:
        """One completion per prompt; ``budgets``: per prompt, the new tokens it may take (resumed responses)."""
        budgets = checked_budgets(budgets, len(prompts), sampling)
        if self.released:
            self.broadcast("/resume_memory_occupation", {})
            self.released = False
        results: list[Optional[Completion]] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        base_seed = sampling.seed if seed is None else seed
        top_num = top_logprobs_num(sampling, self.cfg.top_logprobs_num, self.vocab_size)
        for _round in range(3):
            failed_servers: dict[int, Exception] = {}

            def one(i: int, server: int) -> Completion:
                if self._paused.is_set():  # not sent: resumed later from the prompt alone
                    return Completion(list(prompts[i]), [], [], PAUSED, self.weight_version)
                params = sampling_params(sampling, base_seed + i)
                if budgets is not None:
                    params["max_new_tokens"] = budgets[i]
                payload = {"input_ids": list(prompts[i]), "sampling_params": params, "return_logprob": True}
                if top_num:
                    payload["top_logprobs_num"] = top_num
                if self.routing is not None:
                    payload["return_routed_experts"] = True
                where = f"{self.urls[server]} prompt {i}"
                return self.call(
                    server,
                    "/generate",
                    payload,
                    parse=lambda body: parse_generate(
                        body,
                        prompts[i],
                        self.weight_version,
                        where,
                        sampling,
                        self.vocab_size,
                        top_num,
                        self.routing,
                        paused=self._paused.is_set(),
                    ),
                )

            with ThreadPoolExecutor(self.cfg.max_concurrency) as pool:
                futures = {i: (pool.submit(one, i, i % len(self.urls)), i % len(self.urls)) for i in pending}
                unfinished = []
                for i, (future, server) in futures.items():
                    try:
                        results[i] = future.result()
                    except ServerUnavailable as err:
                        log.warning("prompt %d on %s: %s", i, self.urls[server], err)
                        unfinished.append(i)
                        failed_servers[server] = err
            if not unfinished:
                return results  # type: ignore[return-value]
            for server in sorted(failed_servers):
                self.recover(server, failed_servers[server])
            self.counters["reissued"] += len(unfinished)
            pending = unfinished
            log.warning("re-issuing %d request(s) after recovering server(s) %s", len(pending), sorted(failed_servers))
        raise ServerUnavailable(f"{len(pending)} request(s) still failing after restarting the servers 3 times")

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, named_tensors, version: int) -> None:
        """Push HF-named full tensors (an iterable, streamed) as weight version ``version``: generation is
        paused around the update and the radix cache flushed; colocated servers get their memory back first.
        A server that dies during the update is restarted and sent the new weights again; ``weight_version``
        advances only after every server confirmed them."""
        with self._lock:
            if self.released:
                self.broadcast("/resume_memory_occupation", {"tags": ["weights"]}, recover=True)
            self.broadcast("/pause_generation", {"mode": "abort"}, recover=True)
            self.sync.push(self, named_tensors, version)  # atomic: recorded once every server confirmed
            self.broadcast("/flush_cache", recover=True)
            self.broadcast("/continue_generation", {}, recover=True)
            if self.released:
                self.broadcast("/resume_memory_occupation", {"tags": ["kv_cache"]}, recover=True)
                self.released = False
            self.weight_version = version

    @property
    def last_sync(self):
        """The last weight sync's :class:`~megatron_kl.rollout.delta.SyncStats` (None before the first)."""
        return self.sync.last_sync

    def release_memory(self) -> None:
        """Colocated: hand the GPU memory (weights and KV cache) back to the trainer until the next update."""
        if self.cfg.colocated and not self.released:
            self.broadcast("/release_memory_occupation", {})
            self.released = True

    def shutdown(self) -> None:
        for server in self.servers:
            if server is not None:
                server.stop()
        for session in self._sessions:
            session.close()
        self.sync.close()
