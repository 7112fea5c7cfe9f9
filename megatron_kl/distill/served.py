"""A teacher behind inference servers (``distill.teacher.source: server``): its log-probs at the sampled tokens and
its top-k per position, asked over HTTP; no teacher weights in the job. One request per sequence, prefill only, in
either server's API (``distill.teacher.server.api``):

``sglang`` (SGLang 0.5.x ``/generate``, ``srt/managers/io_struct.py`` GenerateReqInput):

    {input_ids: prompt + response, sampling_params: {max_new_tokens: 0, temperature: 1}, return_logprob: true,
     logprob_start_len: P - 1, top_logprobs_num: k}
    -> meta_info.input_token_logprobs: [[logprob | null, token_id, text | null], ...]  one per input position from
       logprob_start_len on: the log-prob of that position's token given the tokens before it (null where nothing
       precedes it), the full softmax(z) (T = 1);
       meta_info.input_top_logprobs: [[[logprob, token_id, text | null] x k] | null, ...]  the k most likely tokens
       of the same distributions.

``vllm`` (vLLM's OpenAI server, ``/v1/completions`` with token ids as the prompt):

    {model, prompt: prompt + response, max_tokens: 1, temperature: 1, prompt_logprobs: k}
    -> choices[0].prompt_logprobs: [null, {"<token_id>": {logprob, rank, decoded_token}, ...}, ...]  one per prompt
       position: the k most likely tokens (rank 1..k) and the position's own token (whatever its rank).

The SGLang request asks from P - 1 (the last prompt token), read for nothing but its echoed token id: asking from there,
not from P, does not depend on whether a server fills the first entry. Every answer is checked the same way
(:func:`checked_scores`): the echoed token ids must be the request's, every log-prob finite and <= 0, k distinct top
ids per response position inside the vocabulary, sorted, and agreeing with the sampled token's log-prob when it is
among them; values that cannot be right are a :class:`~megatron_kl.rollout.http.CorruptResponse` (retried like a 5xx,
then an error naming the field and the server), a body of another shape a ``ServerError``. The vocabulary itself
cannot be asked of a server: give ``distill.teacher.hf_checkpoint`` (the directory it serves) and ``--check``
compares its vocabulary and tokenizer with the student's.

In the job, the last pipeline stage's first tensor- and context-parallel rank of each data-parallel replica asks for
its replica's rows (requests in flight at most ``distill.teacher.server.max_concurrency``, round-robin over the
urls) and hands the results to the replica's other ranks: one request per sequence, whatever the layout.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from megatron_kl.distill.config import TeacherServer
from megatron_kl.models import pipeline
from megatron_kl.models.parallel import collective_device
from megatron_kl.rollout.http import CorruptResponse, RetryPolicy, ServerError, call, new_session

log = logging.getLogger(__name__)


def score_payload(input_ids: list[int], start: int, k: int) -> dict:
    """The SGLang /generate body that scores ``input_ids`` from position ``start`` on with the top ``k`` per
    position."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": int(start),
        "top_logprobs_num": int(k),
    }


def vllm_score_payload(input_ids: list[int], k: int, model: str) -> dict:
    """The vLLM /v1/completions body that scores every position of ``input_ids`` with the top ``k`` (one token is
    generated and not read: vLLM's max_tokens is at least 1)."""
    return {
        "model": model,
        "prompt": list(input_ids),
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": int(k),
        "skip_special_tokens": False,
    }


def _number(value, field: str, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ServerError(f"{where}: {field} has a non-numeric log-prob {value!r}") from None
    if not math.isfinite(number) or number > 1e-6:
        raise CorruptResponse(f"{where}: {field} has the log-prob {number!r} (finite and <= 0 expected)")
    return min(number, 0.0)


def parse_scores(
    body, input_ids: list[int], start: int, k: int, vocab_size: int, where: str
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """An SGLang scoring answer -> (log-probs of ``input_ids[start + 1:]``, their top-``k`` ids, their top-``k``
    log-probs), one entry per position after ``start`` (module docstring); an impossible value is a
    ``CorruptResponse``, another shape a ``ServerError``, each naming the field."""
    if body is None:
        raise CorruptResponse(f"{where}: /generate answered an empty body")
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise ServerError(f"{where}: the scoring answer has no meta_info object")
    tokens, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    expected = len(input_ids) - start
    if not isinstance(tokens, list) or len(tokens) != expected:
        raise CorruptResponse(
            f"{where}: meta_info.input_token_logprobs has "
            f"{len(tokens) if isinstance(tokens, list) else 'no'} entries, expected {expected} (one "
            f"per input position from logprob_start_len={start}; return_logprob=true was sent)"
        )
    if k and (not isinstance(tops, list) or len(tops) != expected):
        raise CorruptResponse(
            f"{where}: meta_info.input_top_logprobs has {len(tops) if isinstance(tops, list) else 'no'}"
            f" entries, expected {expected} (top_logprobs_num={k} was sent)"
        )
    positions = []
    for offset, entry in enumerate(tokens):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise ServerError(f"{where}: meta_info.input_token_logprobs[{offset}] is not [logprob, token_id, ...]")
        top = tops[offset] if k else []
        if (
            k
            and offset
            and (not isinstance(top, list) or not all(isinstance(t, (list, tuple)) and len(t) >= 2 for t in top))
        ):
            raise CorruptResponse(
                f"{where}: meta_info.input_top_logprobs[{offset}] is not [[logprob, token_id, ...], ...]"
            )
        positions.append(
            (
                entry[1],
                entry[0],
                [(t[0], t[1]) for t in top or []],
                f"input_token_logprobs[{offset}]",
                f"input_top_logprobs[{offset}]",
            )
        )
    return checked_scores(positions, input_ids, start, k, vocab_size, where, "meta_info")


def parse_vllm_scores(
    body, input_ids: list[int], start: int, k: int, vocab_size: int, where: str
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """A vLLM ``/v1/completions`` answer with ``prompt_logprobs`` -> what :func:`parse_scores` returns."""
    try:
        entries = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise CorruptResponse(
            f"{where}: no choices[0].prompt_logprobs in the answer (prompt_logprobs={k} was sent)"
        ) from None
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        raise CorruptResponse(
            f"{where}: choices[0].prompt_logprobs has "
            f"{len(entries) if isinstance(entries, list) else 'no'} entries, expected "
            f"{len(input_ids)} (one per prompt token)"
        )
    positions = []
    for position in range(start, len(input_ids)):
        entry, field = entries[position], f"prompt_logprobs[{position}]"
        if position == start:  # nothing read from it (it may be the first position: null)
            positions.append((input_ids[position], None, [], field, field))
            continue
        if not isinstance(entry, dict) or not all(isinstance(v, dict) and "logprob" in v for v in entry.values()):
            raise CorruptResponse(f"{where}: choices[0].{field} is not {{token_id: {{logprob, rank}}}}")
        token = input_ids[position]
        if str(token) not in entry:
            raise CorruptResponse(f"{where}: choices[0].{field} lacks the prompt's token {token}")
        try:
            ranked = sorted((int(v.get("rank", 0)), int(key), v["logprob"]) for key, v in entry.items())
        except (TypeError, ValueError):
            raise ServerError(f"{where}: choices[0].{field} has a key or rank that is not a number") from None
        top = [(logprob, token_id) for rank, token_id, logprob in ranked if 1 <= rank <= k]
        positions.append((token, entry[str(token)]["logprob"], top, field, field))
    return checked_scores(positions, input_ids, start, k, vocab_size, where, "choices[0]")


def checked_scores(
    positions, input_ids: list[int], start: int, k: int, vocab_size: int, where: str, root: str
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """The checks both APIs' answers pass (module docstring). ``positions``: per position from ``start`` on, (the
    echoed token id, its log-prob, [(top log-prob, top id), ...], the field of each for the errors)."""
    logprobs, top_ids, top_logprobs = [], [], []
    for offset, (echoed, logprob, top, field, top_field) in enumerate(positions):
        position = start + offset
        if echoed != input_ids[position]:
            raise CorruptResponse(
                f"{where}: {root}.{field} is for token {echoed!r}, the request's token at position "
                f"{position} is {input_ids[position]}"
            )
        if offset == 0:
            continue  # the position before the first target: its id checked, its log-prob unused
        logprobs.append(_number(logprob, f"{root}.{field}", where))
        if k == 0:
            continue
        if len(top) < k:
            raise CorruptResponse(f"{where}: {root}.{top_field} holds {len(top)} top entries, {k} expected")
        values = [_number(value, f"{root}.{top_field}", where) for value, _ in top[:k]]
        ids = [token for _, token in top[:k]]
        if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids) or len(set(ids)) != k:
            raise CorruptResponse(
                f"{where}: {root}.{top_field} has token ids {ids}: {k} distinct ids in [0, {vocab_size}) expected"
            )
        if any(b > a + 1e-5 for a, b in zip(values, values[1:])):
            raise CorruptResponse(f"{where}: {root}.{top_field} is not sorted by log-prob")
        if input_ids[position] in ids and abs(values[ids.index(input_ids[position])] - logprobs[-1]) > 1e-3:
            raise CorruptResponse(
                f"{where}: {root}.{top_field} gives token {input_ids[position]} another log-prob than {root}.{field}"
            )
        top_ids.append(ids)
        top_logprobs.append(values)
    return logprobs, top_ids, top_logprobs


class _Resident:
    """A served teacher holds no weights here: nothing to bring back."""

    def resident(self):
        return nullcontext()


class ServedTeacher:
    """The teacher of ``distill.teacher.server`` (module docstring), with :class:`~megatron_kl.distill.teacher.Teacher`'s
    step interface: :meth:`score` (its log-probs at the sampled tokens), then :meth:`top_k` (the top-k of the same
    answers). No head: there are no teacher logits for an exact KL."""

    head = None

    def __init__(self, cfg: TeacherServer, vocab_size: int, top_k: int, topology):
        self.cfg, self.vocab_size, self.k, self.topology = cfg, vocab_size, top_k, topology  # k 0: no top-k
        self.offload = _Resident()
        key = os.environ.get(cfg.api_key_env)
        self.session = new_session(cfg.max_concurrency, {"Authorization": f"Bearer {key}"} if key else None)
        self.policy = RetryPolicy(cfg.max_retries, cfg.backoff_s, cfg.request_timeout_s)
        self._urls = itertools.cycle(cfg.urls)
        self._top: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._models: dict[str, str] = {}  # vLLM: url -> the served model's name

    def _score_row(self, tokens: list[int], start: int, url: str):
        where = f"teacher server {url}"
        hint = (
            f"set the environment variable distill.teacher.server.api_key_env names (now {self.cfg.api_key_env}) "
            "to the teacher server's --api-key"
        )
        if self.cfg.api == "vllm":
            payload = vllm_score_payload(tokens, self.k, self._model_name(url, hint))
            return call(
                url,
                "/v1/completions",
                payload,
                self.policy,
                session=self.session,
                auth_hint=hint,
                parse=lambda body: parse_vllm_scores(body, tokens, start, self.k, self.vocab_size, where),
            )
        return call(
            url,
            "/generate",
            score_payload(tokens, start, self.k),
            self.policy,
            session=self.session,
            parse=lambda body: parse_scores(body, tokens, start, self.k, self.vocab_size, where),
            auth_hint=hint,
        )

    def _model_name(self, url: str, hint: str) -> str:
        """The model a vLLM server serves (its /v1/models), asked once per url."""
        if url not in self._models:
            body = call(url, "/v1/models", None, self.policy, "GET", session=self.session, auth_hint=hint)
            try:
                self._models[url] = str(body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise ServerError(f"teacher server {url}: /v1/models answered no data[0].id") from None
        return self._models[url]

    def _fetch(self, sequences: pipeline.SequenceBatch):
        rows, width = sequences.loss_mask.shape
        logprobs = torch.zeros(rows, width)
        ids = torch.zeros(rows, width, self.k, dtype=torch.long)
        top = torch.zeros(rows, width, self.k)
        jobs = []
        for row in range(rows):
            on = sequences.loss_mask[row].nonzero().squeeze(-1)
            if on.numel():
                first, last = int(on[0]), int(on[-1])  # target positions: tokens first + 1 .. last + 1
                jobs.append((row, first, sequences.tokens[row, : last + 2].tolist(), next(self._urls)))
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, max(1, len(jobs)))) as pool:
            answers = list(pool.map(lambda job: self._score_row(job[2], job[1], job[3]), jobs))
        for (row, first, _, _), (values, top_ids, top_values) in zip(jobs, answers):
            span = slice(first, first + len(values))
            logprobs[row, span] = torch.tensor(values)
            if self.k:
                ids[row, span] = torch.tensor(top_ids, dtype=torch.long)
                top[row, span] = torch.tensor(top_values)
        return logprobs, ids, top

    def score(
        self,
        sequences: pipeline.SequenceBatch,
        microbatches: int,
        vocab: pipeline.VocabOptions,
        capture_hidden: bool = False,
        token_budget: int = 0,
    ) -> pipeline.TokenStats:
        """The teacher's log-probs at the sampled tokens [B, S-1] (0 off the loss mask; the entropy is not served:
        zeros); its top-k is kept for :meth:`top_k`. Collective over the replica's model-parallel ranks."""
        if vocab.temperature != 1.0:
            raise ValueError(
                f"a served teacher scores softmax(z) (T = 1); the run's log-prob temperature is {vocab.temperature}"
            )
        shape, top_shape = tuple(sequences.loss_mask.shape), (*sequences.loss_mask.shape, self.k)
        logprobs, ids, top = self._fetch(sequences) if self._asks() else (None, None, None)
        mask = sequences.loss_mask.to(torch.float32)
        if self._last_stage():  # the top-k goes down the pipeline from the step, as a loaded teacher's does
            ids = self._share(ids, top_shape, torch.long, pipeline_too=False)
            top = self._share(top, top_shape, torch.float32, pipeline_too=False) * mask[..., None]
        self._top = ids, top
        logprobs = self._share(logprobs, shape, torch.float32)
        return pipeline.TokenStats(logprobs=logprobs * mask, entropy=torch.zeros(shape))

    def top_k(self, hidden, k: int, vocab, tp_group) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The top-k ids and log-probs [B, S-1, k] of the last :meth:`score` on the last pipeline stage, (None, None)
        elsewhere, as :meth:`Teacher.top_k` (``hidden`` unused: served)."""
        if self._top is None or k != self.k:
            raise RuntimeError(f"ServedTeacher.top_k(k={k}) without a score() for k={self.k} first")
        return self._top

    # -- one request per sequence per data-parallel replica ----------------------------------------------------
    def _groups(self):
        topo = self.topology
        return [g for g in (topo.tp_group, topo.cp_group) if g is not None and dist.get_world_size(g) > 1]

    def _last_stage(self) -> bool:
        group = self.topology.pp_group
        return not dist.is_initialized() or group is None or dist.get_rank(group) == dist.get_world_size(group) - 1

    def _asks(self) -> bool:
        """Whether this rank asks the servers: the last pipeline stage's first TP and CP rank."""
        return self._last_stage() and (not dist.is_initialized() or all(dist.get_rank(g) == 0 for g in self._groups()))

    def _share(self, tensor: Optional[torch.Tensor], shape, dtype, pipeline_too: bool = True) -> torch.Tensor:
        """The asking rank's tensor on every rank of its replica's last pipeline stage (TP and CP groups) and, with
        ``pipeline_too``, on every stage."""
        if not dist.is_initialized() or 0 in shape:
            return tensor if tensor is not None else torch.zeros(shape, dtype=dtype)
        if self._last_stage():
            for group in self._groups():
                device = collective_device(group)
                buffer = (tensor if tensor is not None else torch.zeros(shape, dtype=dtype)).to(device).contiguous()
                dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
                tensor = buffer.cpu()
        if pipeline_too and self.topology.pp_group is not None and dist.get_world_size(self.topology.pp_group) > 1:
            return pipeline.broadcast_from_last_stage(tensor, shape, dtype)
        return tensor
