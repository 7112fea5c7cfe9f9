"""The SGLang test server's impossible answers: the ways a ``/generate`` response (``--fault-corrupt-every``), a
teacher's input log-probs (``--fault-scores-every``) or the routed experts (``--fault-routing-every``) are made
wrong, each a fault the client must name."""

from __future__ import annotations

import base64

CORRUPTIONS = ("nan", "inf", "positive", "oov", "negative", "too_long", "empty")

SCORE_CORRUPTIONS = ("missing", "nan", "short", "token", "unsorted")


def corrupt_scores(meta: dict, kind: str) -> None:
    """A scoring answer's ``meta`` with one impossible value of the given kind (its last entry altered)."""
    entries, tops = meta["input_token_logprobs"], meta.get("input_top_logprobs")
    if kind == "missing":
        meta.pop("input_token_logprobs")
    elif kind == "nan":
        entries[-1][0] = float("nan")
    elif kind == "short":
        entries.pop()
    elif kind == "token":
        entries[-1][1] += 1
    elif kind == "unsorted" and tops and tops[-1] and len(tops[-1]) > 1:
        tops[-1][0], tops[-1][-1] = tops[-1][-1], tops[-1][0]


def corrupt(response: dict, kind: str, vocab_size: int) -> dict:
    """``response`` (a /generate answer) with one impossible value of the given kind."""
    meta = response["meta_info"]
    entries = meta.get("output_token_logprobs") or [[-1.0, 1, None]]
    if kind in ("nan", "inf", "positive"):
        entries[0][0] = {"nan": float("nan"), "inf": float("inf"), "positive": 0.5}[kind]
    elif kind in ("oov", "negative"):
        entries[0][1] = vocab_size + 3 if kind == "oov" else -1
    elif kind == "too_long":
        entries = entries + [list(entries[-1]) for _ in range(1000)]
    elif kind == "empty":
        entries = []
        response.pop("output_ids", None)
    meta["output_token_logprobs"] = entries
    if "output_ids" in response:
        response["output_ids"] = [e[1] for e in entries]
    return response


ROUTING_CORRUPTIONS = ("short", "out_of_range", "repeated")


def corrupt_routing(meta: dict, kind: str, num_experts: int) -> None:
    """``meta_info.routed_experts`` with one impossible value: a position fewer, an expert id past the experts, or
    the same expert twice in one token's top-k."""
    import numpy as np

    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").copy()
    if kind == "short":
        raw = raw[: max(0, raw.size - raw.size // max(1, meta["prompt_tokens"] + meta["completion_tokens"] - 1))]
    elif kind == "out_of_range":
        raw[0] = num_experts
    elif kind == "repeated" and raw.size > 1:
        raw[1] = raw[0]
    meta["routed_experts"] = base64.b64encode(raw.astype("<i4").tobytes()).decode("ascii")
