"""A stand-in for ``python -m sglang.launch_server`` on machines without SGLang (CPU): the subset of SGLang's
HTTP API that :mod:`megatron_kl.rollout.sglang` uses, served by the embedded engine on an HF checkpoint.

Request and response shapes follow SGLang 0.5.x (``srt/managers/io_struct.py`` and
``srt/entrypoints/http_server.py``): ``/generate`` with ``input_ids`` and ``max_new_tokens: 0`` scores the input
(``meta_info.input_token_logprobs`` and, with ``top_logprobs_num``, ``input_top_logprobs`` from
``logprob_start_len`` on, log softmax(z) at temperature 1; null where no token precedes); otherwise it answers
``output_ids`` and
``meta_info.{finish_reason, output_token_logprobs, weight_version, prompt_tokens, completion_tokens}`` (and, for a
mixture-of-experts model started with ``--enable-return-routed-experts`` and a request with
``return_routed_experts: true``, ``routed_experts``: the engine's recorded routing in SGLang's base64 int32 format);
the weight-update routes answer ``{success, message}``. It takes the same command-line flags as
``sglang.launch_server`` (those it does not need are accepted and ignored; ``--api-key`` is enforced as
SGLang does: 401 without ``Authorization: Bearer <key>``, health checks exempt) plus failure injection:

    --fault-500-every N        every N-th /generate answers HTTP 500
    --fault-delay-every N      every N-th /generate sleeps --fault-delay-s before answering (client timeouts)
    --fault-drop-every N       every N-th /generate closes the connection without an answer
    --fault-bad-every N        every N-th /generate answers without meta_info.output_token_logprobs
    --fault-malformed-every N  every N-th /generate answers meta_info: null (a structural error, not retried)
    --fault-corrupt-every N    every N-th /generate answers a well-formed body with impossible values, cycling
                               through CORRUPTIONS (NaN / +inf / positive log-prob, id >= vocab, id < 0, more
                               tokens than max_new_tokens, an empty completion without output_ids)
    --fault-off-support-every N
                               every N-th /generate with top log-probs reports its first token as one outside
                               the top-k / top-p support (log-prob below every returned top log-prob)
    --fault-routing-every N    every N-th /generate that returns routed experts answers an impossible routing,
                               cycling through ROUTING_CORRUPTIONS (a position fewer, an expert id past the
                               experts, one expert twice in a token's top-k)
    --fault-hang-after N       every /generate after the N-th never answers (a hung server); writes
                               --fault-marker when the first one hangs
    --fault-exit-at N          the N-th /generate kills the process, once per --fault-marker file
    --fault-exit-on-update N   the N-th weight update (/update_weights_from_*) kills the process before
                               answering, once per --fault-marker file
    --fault-scores-every N     every N-th /generate that scores its input (max_new_tokens 0, logprob_start_len set:
                               a served distillation teacher) answers impossible input log-probs, cycling through
                               SCORE_CORRUPTIONS (the field missing, a NaN log-prob, an entry fewer, another token
                               echoed, a top-k list out of order)
    --no-pause-routes          /pause_generation and /continue_generation answer 404 (an SGLang without them)
    --fault-delta-at N         the N-th /update_weights_from_tensor through a custom weight loader arrives with one
                               delta value altered (the loader's checksum must catch it)

and latency, for measuring rollouts:

    --token-latency-s S        every generated token takes S seconds to come out (as a GPU server's decode step;
                               requests overlap, as under continuous batching); /pause_generation (mode abort) cuts
                               the requests in flight at the tokens already out and answers them with finish_reason
                               abort, SGLang's partial answer
    --long-every N             the requests of one prompt in N (by a hash of the first --long-prefix-tokens input ids,
                               so a resumed request, whose input starts with its prompt, stays long) ignore their stop
                               tokens and run to max_new_tokens: a heavy tail of long responses (with a model whose
                               answers stop after a few tokens, ~10x the median)

Run ``python -m megatron_kl.testing.sglang_server --model-path DIR --port P``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import importlib
import json
import os
import socket
import threading
import time
import uuid
import zlib
from contextlib import nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from megatron_kl.models.routing_replay import replayed
from megatron_kl.testing.corruptions import (
    CORRUPTIONS,
    ROUTING_CORRUPTIONS,
    SCORE_CORRUPTIONS,
    corrupt,
    corrupt_routing,
    corrupt_scores,
)


def encode_routed_experts(ids: torch.Tensor) -> str:
    """SGLang's wire format of a routing: base64 of the int32 ids, token-major, then layer, then top-k slot."""
    return base64.b64encode(ids.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


class _DictCheckpoint:
    """HF tensors held in memory (what weight updates write into), read like an HFCheckpoint."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"no HF tensor {name!r}")
        return self.tensors[name]

    def get_row(self, name: str, index: int) -> torch.Tensor:
        return self.get(name)[index]


class _LoaderModel:
    """The server's model as SGLang's weight loaders see it: ``load_weights([(hf_name, tensor), ...])`` loads the
    tensors given and keeps the others."""

    def __init__(self, server: "EmbeddedServer"):
        self.server = server

    def load_weights(self, named) -> None:
        for name, tensor in named:
            if name not in self.server.tensors:
                raise KeyError(f"no HF tensor {name!r} in this model")
            self.server.tensors[name] = tensor.float().clone()
        self.server._reload()


class EmbeddedServer:
    def __init__(self, args):
        from megatron_kl.config import ParallelConfig
        from megatron_kl.models import hf, parallel
        from megatron_kl.rollout.local import LocalEngine

        self.args = args
        checkpoint = hf.HFCheckpoint(args.model_path)
        self.model = checkpoint.model_config()
        self.vocab_size = self.model.vocab_size
        self.tensors = {name: checkpoint.get(name).float() for name in checkpoint.files}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        parallel.initialize(self.model, ParallelConfig(), seed=args.random_seed)
        self.engine = LocalEngine(self.model, ParallelConfig())
        self._reload()
        self.weight_version = "default"  # SGLang's initial version
        self.paused = False
        self.abort_epoch = 0  # advanced by /pause_generation: requests begun before it are cut
        self.released: set[str] = set()  # memory regions handed back (SGLang's tags: weights, kv_cache)
        self.groups: dict[str, object] = {}
        self.requests = 0
        self.updates = 0
        self.loader_model = _LoaderModel(self)  # what a weight loader calls load_weights on
        self.loader_calls = 0
        self.lock = threading.Lock()
        self.model_lock = threading.Lock()

    def _reload(self) -> None:
        from megatron_kl.models import hf

        if "weights" in getattr(self, "released", ()):
            raise RuntimeError("weights memory released: /resume_memory_occupation {tags: [weights]} first")
        hf.load_hf_into([self.engine.model], _DictCheckpoint(self.tensors), self.model)
        if self.args.quantization == "fp8":  # as SGLang's --quantization fp8: block-wise FP8 linear weights
            from megatron_kl.rollout.quantization import quantize_model_

            quantize_model_(self.engine.model)

    # -- routes ----------------------------------------------------------------------------------
    def generate(self, body: dict, long: bool = False) -> dict | list:
        from megatron_kl.rollout.engine import SamplingConfig

        ids = body.get("input_ids")
        if ids is None:
            raise ValueError("this test server needs input_ids (it has no tokenizer: --skip-tokenizer-init)")
        if ids and isinstance(ids[0], list):
            return [self.generate({**body, "input_ids": one}, long) for one in ids]
        if self.paused:
            return self._response(ids, [], [], {"type": "abort", "message": "generation paused"})
        if self.released:
            raise RuntimeError(f"memory released ({sorted(self.released)}): call /resume_memory_occupation first")
        params = body.get("sampling_params") or {}
        if int(params.get("max_new_tokens", 128)) == 0:
            return self.score(body, ids)
        sampling = SamplingConfig(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=max(0, int(params.get("top_k", -1))),
            max_new_tokens=int(params.get("max_new_tokens", 128)),
            stop_token_ids=[] if long else list(params.get("stop_token_ids") or []),
        )
        seed = params.get("sampling_seed")
        epoch = self.abort_epoch
        with self.model_lock:  # one forward at a time: megatron's MoE layers keep per-call state on the module
            completion = self.engine.generate([ids], sampling, seed=None if seed is None else int(seed))[0]
        kept = self._stream(len(completion.response_ids), epoch)
        with self.model_lock:
            return self._generate_one(body, ids, sampling, completion, kept)

    @torch.no_grad()
    def score(self, body: dict, ids: list) -> dict:
        """Prefill only (module docstring): the input's log-probs and top log-probs from ``logprob_start_len`` on."""
        start = int(body.get("logprob_start_len", -1))
        if not body.get("return_logprob") or not 0 <= start < len(ids):
            raise ValueError(f"scoring needs return_logprob and 0 <= logprob_start_len < {len(ids)} (got {start})")
        top_num = int(body.get("top_logprobs_num") or 0)
        tokens = torch.as_tensor([list(ids)], device=self.engine.device)
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        with self.model_lock:
            logits = self.engine.model(tokens, positions, None)[0, :, : self.vocab_size].float()
        logp = torch.log_softmax(logits, -1)
        entries, tops = [], []
        for position in range(start, len(ids)):
            if position == 0:
                entries.append([None, int(ids[0]), None])
                tops.append(None)
                continue
            row = logp[position - 1]
            entries.append([float(row[ids[position]]), int(ids[position]), None])
            if top_num:
                values, index = row.topk(min(top_num, row.shape[-1]))
                tops.append([[v, i, None] for v, i in zip(values.tolist(), index.tolist())])
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "input_token_logprobs": entries,
            "input_top_logprobs": tops if top_num else None,
            "output_token_logprobs": [],
        }
        return {"output_ids": [], "meta_info": meta}

    def _stream(self, tokens: int, epoch: int) -> int:
        """With --token-latency-s: the tokens come out one per latency; a pause (abort) since the request began cuts
        them at those already out. Returns how many are kept (all without latency)."""
        latency = self.args.token_latency_s
        for out in range(tokens):
            if latency <= 0:
                break
            if self.abort_epoch != epoch:
                return out
            time.sleep(latency)
        return tokens

    def _generate_one(self, body: dict, ids, sampling, completion, kept: int) -> dict:
        if kept < len(completion.response_ids):  # cut by /pause_generation: SGLang's aborted answer
            completion = dataclasses.replace(
                completion,
                response_ids=completion.response_ids[:kept],
                response_logprobs=completion.response_logprobs[:kept],
                finish_reason="abort",
                routed_experts=None
                if completion.routed_experts is None
                else completion.routed_experts[: len(ids) + kept - 1],
            )
        if completion.finish_reason == "abort":
            finish = {"type": "abort", "message": "Abort before the request finished (pause_generation)"}
        elif completion.finish_reason == "stop":
            finish = {"type": "stop", "matched": completion.response_ids[-1]}
        else:
            finish = {"type": "length", "length": len(completion.response_ids)}
        logprobs = top = None
        if body.get("return_logprob"):  # as SGLang's sampler: log softmax(z / T) of the full distribution
            logprobs, top = self._tempered_logprobs(
                ids,
                completion.response_ids,
                sampling.logprob_temperature,
                int(body.get("top_logprobs_num") or 0),
                completion.routed_experts,
            )
        response = self._response(ids, completion.response_ids, logprobs, finish, top)
        if body.get("return_routed_experts"):
            if not self.args.enable_return_routed_experts:
                raise ValueError("return_routed_experts needs the server flag --enable-return-routed-experts")
            if completion.routed_experts is None:
                raise ValueError("return_routed_experts: this model has no mixture-of-experts layers")
            response["meta_info"]["routed_experts"] = encode_routed_experts(completion.routed_experts)
        return response

    @torch.no_grad()
    def _tempered_logprobs(self, prompt, response, temperature: float, top_num: int, routing=None):
        """log softmax(z / T) of the sampled tokens over the whole vocabulary and the ``top_num`` largest per
        position, recomputed from the sequence (SGLang takes them from the sampler's tempered probabilities,
        before its top-k / top-p renormalisation); a mixture-of-experts model's forward routes each token to the
        experts it had while sampling (``routing``), so the log-probs are those of the network that sampled."""
        if not response:
            return [], [] if top_num else None
        tokens = torch.as_tensor([list(prompt) + list(response)], device=self.engine.device)
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        if routing is not None:  # [P + R - 1, L, k] -> [1, P + R, L, k], the last position unrouted
            routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, 1), value=-1)[None]
        with replayed(self.engine.model, routing) if routing is not None else nullcontext():
            logits = self.engine.model(tokens, positions, None)[0, len(prompt) - 1 : -1, : self.vocab_size].float()
        logp = torch.log_softmax(logits / temperature, -1)
        chosen = logp.gather(-1, torch.as_tensor(response, device=logp.device)[:, None])[:, 0].tolist()
        if not top_num:
            return chosen, None
        values, index = logp.topk(min(top_num, logp.shape[-1]), dim=-1)
        top = [[[v, i, None] for v, i in zip(vs, ix)] for vs, ix in zip(values.tolist(), index.tolist())]
        return chosen, top

    def _response(self, ids, output_ids, logprobs, finish, top=None) -> dict:
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if logprobs is not None:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, output_ids)]
        if top is not None:
            meta["output_top_logprobs"] = top
        return {"output_ids": list(output_ids), "meta_info": meta}

    def _set_version(self, body) -> None:
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])

    def update_weights_from_disk(self, body: dict) -> dict:
        from megatron_kl.models import hf

        checkpoint = hf.HFCheckpoint(body["model_path"])  # the tensors it holds (SGLang loads what the files have)
        self.tensors.update({name: checkpoint.get(name).float() for name in checkpoint.files})
        self._reload()
        self._set_version(body)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def update_weights_from_tensor(self, body: dict) -> dict:
        from megatron_kl.rollout.sglang_sync import deserialize_tensors

        named = deserialize_tensors(body["serialized_named_tensors"][0])  # one entry per server TP rank
        load_format = body.get("load_format")
        if load_format:  # SGLang: a dotted path registered with --custom-weight-loader, called (model, named)
            if load_format not in (self.args.custom_weight_loader or []):
                return {
                    "success": False,
                    "message": f"Unknown load_format={load_format} (not in --custom-weight-loader)",
                }

            self.loader_calls += 1
            if self.loader_calls == self.args.fault_delta_at:
                for name, tensor in named:  # one changed element's value arrives altered (a corrupted delta)
                    if name.endswith("@delta:values") and tensor.numel():
                        tensor.view(-1)[0] += 1
                        break
            module, function = load_format.rsplit(".", 1)
            try:
                getattr(importlib.import_module(module), function)(self.loader_model, named)
            except Exception as err:  # noqa: BLE001 - answered as a failed update, weights unchanged
                return {"success": False, "message": f"{type(err).__name__}: {err}"}
        else:
            self.loader_model.load_weights(named)
        self._set_version(body)
        return {"success": True, "message": "Succeeded to update model weights."}

    def init_weights_update_group(self, body: dict) -> dict:
        from megatron_kl.rollout.sglang_sync import new_external_group

        group = new_external_group(
            body.get("backend", "nccl"),
            body["master_address"],
            int(body["master_port"]),
            int(body["world_size"]),
            int(body["rank_offset"]),
            body.get("group_name", "g"),
        )
        self.groups[body.get("group_name", "weight_update_group")] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict) -> dict:
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return {"success": False, "message": f"no weight update group {body.get('group_name')!r}"}
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            group.broadcast(tensor, 0).wait()
            self.tensors[name] = tensor.float()
        self._reload()
        self._set_version(body)
        return {"success": True, "message": "Succeeded to update parameter online."}

    def control(self, path: str, body: dict) -> dict:
        if path == "/pause_generation":
            self.paused = True
            self.abort_epoch += 1
        elif path == "/continue_generation":
            self.paused = False
        elif path == "/release_memory_occupation":
            self.released = {"weights", "kv_cache"}
        elif path == "/resume_memory_occupation":
            self.released -= set(body.get("tags") or ["weights", "kv_cache"])
        return {"success": True, "message": ""}


def _handler(server: EmbeddedServer, args):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path in ("/health", "/health_generate"):
                self._send(200, {})
            elif not self._authorized():
                return
            elif self.path == "/get_weight_version":
                self._send(200, {"weight_version": server.weight_version})
            elif self.path == "/get_server_info":
                self._send(
                    200,
                    {
                        "model_path": args.model_path,
                        "tp_size": args.tp_size,
                        "version": "test-0.5",
                        "quantization": args.quantization,
                    },
                )
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def _authorized(self) -> bool:
            """SGLang's --api-key: every route but the health checks needs ``Authorization: Bearer <key>``."""
            if not args.api_key or self.headers.get("Authorization") == f"Bearer {args.api_key}":
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            if not self._authorized():
                return
            try:
                if self.path == "/generate":
                    if self._fault():
                        return
                    self._send(200, self._bad(server.generate(body, long=self._long(body))))
                elif self.path in (
                    "/update_weights_from_disk",
                    "/update_weights_from_tensor",
                    "/init_weights_update_group",
                    "/update_weights_from_distributed",
                ):
                    if self.path.startswith("/update_weights") and args.fault_exit_on_update:
                        server.updates += 1
                        if server.updates == args.fault_exit_on_update and not Path(args.fault_marker).exists():
                            Path(args.fault_marker).write_text("exited during a weight update")
                            os._exit(18)
                    with server.lock:
                        self._send(200, getattr(server, self.path[1:])(body))
                elif self.path == "/flush_cache":
                    self._send(200, {"success": True})
                elif self.path in ("/pause_generation", "/continue_generation") and args.no_pause_routes:
                    self._send(404, {"error": f"no route {self.path}"})
                elif self.path in (
                    "/pause_generation",
                    "/continue_generation",
                    "/release_memory_occupation",
                    "/resume_memory_occupation",
                ):
                    self._send(200, server.control(self.path, body))
                else:
                    self._send(404, {"error": f"no route {self.path}"})
            except Exception as err:  # noqa: BLE001 - a server answers errors as 500s, as SGLang does
                self._send(500, {"error": {"message": f"{type(err).__name__}: {err}"}})

        def _long(self, body: dict) -> bool:
            ids = body.get("input_ids") or []
            if not args.long_every or not ids or isinstance(ids[0], list):
                return False
            prefix = ",".join(str(int(i)) for i in ids[: args.long_prefix_tokens]).encode()
            return zlib.crc32(prefix) % args.long_every == 0

        def _fault(self) -> bool:
            with server.lock:
                server.requests += 1
                n = server.requests
            if args.fault_hang_after and n > args.fault_hang_after:
                if args.fault_marker and not Path(args.fault_marker).exists():
                    Path(args.fault_marker).write_text(f"hung at request {n}")
                threading.Event().wait()  # never answers; the connection stays open
            if args.fault_exit_at and n == args.fault_exit_at and not Path(args.fault_marker).exists():
                Path(args.fault_marker).write_text("exited")
                os._exit(17)
            if args.fault_500_every and n % args.fault_500_every == 0:
                self._send(500, {"error": {"message": "injected failure"}})
                return True
            if args.fault_drop_every and n % args.fault_drop_every == 0:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return True
            if args.fault_delay_every and n % args.fault_delay_every == 0:
                time.sleep(args.fault_delay_s)
            self._bad_now = bool(args.fault_bad_every and n % args.fault_bad_every == 0)
            self._malformed_now = bool(args.fault_malformed_every and n % args.fault_malformed_every == 0)
            self._off_support_now = bool(args.fault_off_support_every and n % args.fault_off_support_every == 0)
            self._corrupt_now = None
            if args.fault_corrupt_every and n % args.fault_corrupt_every == 0:
                self._corrupt_now = CORRUPTIONS[(n // args.fault_corrupt_every - 1) % len(CORRUPTIONS)]
            self._score_fault = None
            if args.fault_scores_every and n % args.fault_scores_every == 0:
                self._score_fault = SCORE_CORRUPTIONS[(n // args.fault_scores_every - 1) % len(SCORE_CORRUPTIONS)]
            self._routing_fault = None
            if args.fault_routing_every and n % args.fault_routing_every == 0:
                self._routing_fault = ROUTING_CORRUPTIONS[
                    (n // args.fault_routing_every - 1) % len(ROUTING_CORRUPTIONS)
                ]
            return False

        def _bad(self, response):
            if getattr(self, "_bad_now", False) and isinstance(response, dict):
                response["meta_info"].pop("output_token_logprobs", None)
            if getattr(self, "_malformed_now", False) and isinstance(response, dict):
                response["meta_info"] = None  # a structural error: not retried, the run's engine error
            meta = response.get("meta_info", {}) if isinstance(response, dict) else {}
            if getattr(self, "_off_support_now", False) and meta.get("output_top_logprobs"):
                meta["output_token_logprobs"][0][0] = min(e[0] for e in meta["output_top_logprobs"][0]) - 5.0
            if getattr(self, "_corrupt_now", None) and isinstance(response, dict):
                response = corrupt(response, self._corrupt_now, server.vocab_size)
            if getattr(self, "_score_fault", None) and "input_token_logprobs" in meta:
                corrupt_scores(meta, self._score_fault)
            if getattr(self, "_routing_fault", None) and "routed_experts" in meta:
                corrupt_routing(meta, self._routing_fault, server.model.moe.num_experts)
            return response

    return Handler


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    for name in ("500", "delay", "drop", "bad", "corrupt", "off-support", "routing", "malformed", "scores"):
        parser.add_argument(f"--fault-{name}-every", type=int, default=0)
    parser.add_argument("--fault-delay-s", type=float, default=0.0)
    parser.add_argument("--fault-exit-at", type=int, default=0)
    parser.add_argument("--fault-hang-after", type=int, default=0)
    parser.add_argument("--fault-exit-on-update", type=int, default=0)
    parser.add_argument("--fault-marker", default="")
    parser.add_argument("--token-latency-s", type=float, default=0.0)
    parser.add_argument("--long-every", type=int, default=0)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--custom-weight-loader", nargs="*", default=[])
    parser.add_argument("--fault-delta-at", type=int, default=0)
    parser.add_argument("--no-pause-routes", action="store_true")
    parser.add_argument("--long-prefix-tokens", type=int, default=4)
    args, _unknown = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    server = EmbeddedServer(args)
    ThreadingHTTPServer((args.host, args.port), _handler(server, args)).serve_forever()


if __name__ == "__main__":
    main()
