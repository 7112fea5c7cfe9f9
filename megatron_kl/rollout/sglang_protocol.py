"""SGLang's ``/generate`` request and response: the sampling parameters sent, and the answer parsed and checked.

- ``POST /generate`` ``{input_ids, sampling_params, return_logprob: true}`` -> ``{output_ids, meta_info: {finish_reason:
  {type: stop|length|abort, ...}, output_token_logprobs: [[logprob, token_id, text|null], ...], output_top_logprobs:
  [[[logprob, token_id, text|null], ...], ...], weight_version, ...}}`` (SGLang 0.5.x, ``srt/managers/io_struct.py``).
  The output log-probs are those of the temperature-scaled full distribution, log softmax(z / T), taken before the
  top-k / top-p renormalisation inside the sampling kernel (``srt/layers/sampler.py``); with top-k / top-p the
  client asks for ``top_logprobs_num``, finds the support from them with the trainer's rule and reports
  log mu(y) = log pi_T(y) - log pi_T(support) (:func:`processed_logprobs`).
- With routing replay each request sends ``return_routed_experts: true``; ``meta_info.routed_experts`` is the base64
  of int32 expert ids ``[prompt + output - 1, layers, top-k]``, checked for shape and range
  (:func:`decode_routed_experts`).
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_kl.models.routing_replay import UNKNOWN
from megatron_kl.rollout.engine import (
    FINISH_REASONS,
    PAUSED,
    Completion,
    SamplingConfig,
    check_completion,
    check_routing,
)
from megatron_kl.rollout.http import (
    CorruptResponse,
    ServerError,
    ServerUnavailable,
)


class ResponseError(ServerError):
    """A server response without the expected fields (names the field)."""


def sampling_params(sampling: SamplingConfig, seed: Optional[int]) -> dict:
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 disables
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token: the trainer learns to emit it
    }
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def top_logprobs_num(sampling: SamplingConfig, cfg_num: int, vocab_size: Optional[int]) -> int:
    """How many top log-probs per position the client needs to rebuild the truncated distribution (0: none)."""
    if not sampling.truncates(vocab_size):
        return 0
    top_k = sampling.top_k if sampling.top_k > 0 and (vocab_size is None or sampling.top_k < vocab_size) else 0
    return top_k if top_k else (cfg_num if vocab_size is None else min(cfg_num, vocab_size))


def processed_logprobs(
    logprobs: list[float], token_ids: list[int], top: list, sampling: SamplingConfig, requested: int, where: str
) -> list[float]:
    """log mu(y_t) of the truncated distribution from SGLang's log pi_T(y_t) and the ``requested`` largest
    log pi_T per position (``top[t]``: [[logprob, token_id, ...], ...]), by the trainer's rule (ties at a cut
    kept; vocab_parallel.truncation). The sampled token must lie in the support (``CorruptResponse`` naming the position);
    a top-p support that does not close within the top log-probs is a ``ResponseError`` naming the setting."""
    top_k = sampling.top_k if 0 < sampling.top_k <= requested else 0  # top_k >= the vocabulary truncates nothing
    top_p = sampling.top_p
    result = []
    for t, (value, token) in enumerate(zip(logprobs, token_ids)):
        try:
            ordered = sorted((float(e[0]) for e in top[t]), reverse=True)
        except (TypeError, ValueError, IndexError):
            raise ResponseError(
                f"{where}: meta_info.output_top_logprobs[{t}] is not [[logprob, token_id, ...], ...]"
            ) from None
        if len(ordered) < requested or any(not math.isfinite(v) for v in ordered):
            raise CorruptResponse(
                f"{where}: meta_info.output_top_logprobs[{t}] has {len(ordered)} finite entries, "
                f"{requested} were requested"
            )
        cut, kept_mass = -math.inf, 1.0  # top-k: the distribution renormalised on the top-k set
        if top_k:
            cut = ordered[min(top_k, len(ordered)) - 1]
            kept_mass = sum(math.exp(v) for v in ordered if v >= cut)
        if top_p < 1.0:
            before, last = 0.0, None
            for v in ordered:
                if v < cut or before >= top_p:
                    break
                last = v
                before += math.exp(v) / kept_mass
            if before < top_p and not top_k and len(ordered) >= requested:
                raise ResponseError(
                    f"{where}: the top-p={top_p} support at response position {t} holds more than the {requested} "
                    "top log-probs asked for: raise rollout.sglang.top_logprobs_num (or set rollout.sampling.top_k)"
                )
            cut = max(cut, last)
        if value < cut - 1e-6:  # the sampled token is outside the support (servers round log-probs)
            raise CorruptResponse(
                f"{where}: sampled token {token} at response position {t} (log-prob {value:.6g}) lies "
                f"outside the top-k/top-p support (cut at log-prob {cut:.6g})"
            )
        result.append(value - math.log(sum(math.exp(v) for v in ordered if v >= cut)))
    return result


@dataclass(frozen=True)
class RoutingShape:
    """What a mixture-of-experts model's routing looks like: ``[tokens, num_layers, router_topk]`` ids in
    [0, num_experts), the first ``dense_layers`` layers without a router (their slots hold what the server wrote:
    SGLang's zeros; read as unknown)."""

    num_layers: int
    router_topk: int
    num_experts: int
    dense_layers: int = 0

    @classmethod
    def of(cls, model) -> Optional["RoutingShape"]:
        """The shape for a ModelConfig with mixture-of-experts layers (None for a dense model)."""
        moe = model.moe
        return cls(model.num_layers, moe.router_topk, moe.num_experts, moe.first_dense_layers) if moe.enabled else None


def decode_routed_experts(value, shape: RoutingShape, completion: Completion, where: str):
    """SGLang's ``meta_info.routed_experts`` (base64 of int32 ids, token-major then layer then top-k slot) as a
    checked ``[P + R - 1, L, k]`` int16 tensor."""
    import numpy as np

    if not isinstance(value, str):
        raise CorruptResponse(
            f"{where}: meta_info.routed_experts missing or not a base64 string "
            "(return_routed_experts=true was sent: is the server started with "
            "--enable-return-routed-experts?)"
        )
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, binascii.Error):
        raise CorruptResponse(f"{where}: meta_info.routed_experts is not valid base64") from None
    per_token = 4 * shape.num_layers * shape.router_topk
    if len(raw) % per_token:
        raise CorruptResponse(
            f"{where}: meta_info.routed_experts has {len(raw)} bytes, not a whole number of "
            f"tokens x {shape.num_layers} layers x top-{shape.router_topk} int32 ids"
        )
    ids = np.frombuffer(raw, dtype="<i4").reshape(-1, shape.num_layers, shape.router_topk)
    completion.routed_experts = torch.from_numpy(ids.astype(np.int16))
    check_routing(completion, shape.num_layers, shape.router_topk, shape.num_experts, where, shape.dense_layers)
    completion.routed_experts[:, : shape.dense_layers] = UNKNOWN
    return completion.routed_experts


def parse_generate(
    body,
    prompt_ids: Sequence[int],
    expected_version: int,
    where: str,
    sampling: Optional[SamplingConfig] = None,
    vocab_size: Optional[int] = None,
    requested_top: int = 0,
    routing: Optional[RoutingShape] = None,
    paused: bool = False,
) -> Completion:
    """A /generate response body -> Completion; anything missing or inconsistent names the field
    (``ResponseError``); values that cannot be right - NaN/inf/positive log-probs, ids outside the
    vocabulary, more than ``max_new_tokens`` tokens, an empty completion without ``output_ids``, with
    ``routing`` a routed-experts field of another shape or with ids outside the experts - are a
    ``CorruptResponse`` (retried like a 5xx). An aborted request is re-issued (``ServerUnavailable``) unless the
    client ``paused`` generation: then it is a partial completion (finish_reason ``abort``) to resume later."""
    if body is None:  # a 200 without a body: a server dying mid-answer (urllib3 does not always notice)
        raise CorruptResponse(f"{where}: /generate answered an empty body")
    if not isinstance(body, dict):
        raise ResponseError(f"{where}: /generate answered {type(body).__name__}, expected an object")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ResponseError(f"{where}: /generate response has no meta_info object")
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type == "abort" and not paused:
        raise ServerUnavailable(f"{where}: request aborted by the server ({finish})")  # re-issued
    if finish_type not in FINISH_REASONS + ((PAUSED,) if paused else ()):
        raise ResponseError(f"{where}: meta_info.finish_reason={finish!r}; expected type in {FINISH_REASONS}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or not all(isinstance(e, (list, tuple)) and len(e) >= 2 for e in entries):
        # retried like the other corrupt answers (a server that drops them now and then); one that never sends
        # them fails after the retries with this message
        raise CorruptResponse(
            f"{where}: meta_info.output_token_logprobs missing or not [[logprob, token_id, ...]] "
            "(return_logprob=true was sent)"
        )
    try:
        logprobs = [float(e[0]) for e in entries]
        token_ids = [int(e[1]) for e in entries]
    except (TypeError, ValueError):
        raise ResponseError(f"{where}: meta_info.output_token_logprobs has a non-numeric entry") from None
    output_ids = body.get("output_ids")
    if not token_ids and output_ids is None and finish_type != PAUSED:
        raise CorruptResponse(
            f"{where}: empty meta_info.output_token_logprobs and no output_ids (a completion has "
            "at least its stop token)"
        )
    if output_ids is not None and list(output_ids) != token_ids:
        raise ResponseError(
            f"{where}: output_ids ({len(output_ids)} tokens) disagree with "
            f"meta_info.output_token_logprobs ({len(token_ids)} tokens)"
        )
    if requested_top and sampling is not None and token_ids:
        top = meta.get("output_top_logprobs")
        if not isinstance(top, list) or len(top) != len(token_ids):
            raise CorruptResponse(
                f"{where}: meta_info.output_top_logprobs missing or not one list per output token "
                f"(top_logprobs_num={requested_top} was sent: the truncated log-probs need it)"
            )
        logprobs = processed_logprobs(logprobs, token_ids, top, sampling, requested_top, where)
    version = meta.get("weight_version")
    if version is None or str(version) != str(expected_version):
        raise ResponseError(
            f"{where}: meta_info.weight_version={version!r} but version {expected_version} was "
            "pushed last (stale or foreign weights)"
        )
    completion = Completion(list(prompt_ids), token_ids, logprobs, finish_type, int(expected_version))
    if sampling is not None:
        check_completion(completion, sampling, vocab_size, where)
    if routing is not None and not (finish_type == PAUSED and not token_ids):
        decode_routed_experts(meta.get("routed_experts"), routing, completion, where)
    return completion
