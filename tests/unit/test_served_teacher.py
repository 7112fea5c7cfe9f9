"""The served teacher's answers (megatron_kl.distill.served.parse_scores): a well-formed scoring answer read position by
position, and each impossible one the test server can inject refused naming the field; the request sent; and the
configuration's refusals for a served teacher."""

import copy
import math

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.distill.served import parse_scores, score_payload
from megatron_kl.rollout.http import CorruptResponse, ServerError
from megatron_kl.testing.corruptions import SCORE_CORRUPTIONS, corrupt_scores
from megatron_kl.train.config import load_train_config

IDS = [5, 9, 2, 7, 3]  # prompt [5, 9], response [2, 7, 3]
START = 1  # the last prompt token


def _answer(k=2):
    entries = [[-0.5 if p else None, IDS[p], None] for p in range(START, len(IDS))]
    tops = []
    for p in range(START, len(IDS)):
        chosen = entries[p - START][0]
        others = sorted([chosen, -0.1 - 0.3 * p, -2.0 - p], reverse=True)[:k]
        tops.append([[v, (IDS[p] if v == chosen else 20 + i), None] for i, v in enumerate(others)])
    return {"output_ids": [], "meta_info": {"input_token_logprobs": entries, "input_top_logprobs": tops}}


def test_a_well_formed_answer_is_read_after_the_start_position():
    logprobs, ids, values = parse_scores(_answer(), IDS, START, 2, 32, "t")
    assert logprobs == [-0.5, -0.5, -0.5] and len(ids) == 3 and all(len(i) == 2 for i in ids)
    assert all(a >= b for row in values for a, b in zip(row, row[1:]))
    assert parse_scores(_answer(), IDS, START, 0, 32, "t")[0] == [-0.5, -0.5, -0.5]  # no top-k asked


@pytest.mark.parametrize("kind", SCORE_CORRUPTIONS)
def test_each_injected_corruption_is_refused_naming_the_field(kind):
    body = copy.deepcopy(_answer())
    corrupt_scores(body["meta_info"], kind)
    with pytest.raises(CorruptResponse, match=r"meta_info\.input_(token|top)_logprobs"):
        parse_scores(body, IDS, START, 2, 32, "teacher server x")


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda m: m["input_top_logprobs"][1].__setitem__(0, [-0.01, 99, None]), CorruptResponse),  # id past the vocab
        (lambda m: m["input_token_logprobs"][2].__setitem__(0, 0.5), CorruptResponse),  # a positive log-prob
        (lambda m: m["input_token_logprobs"][2].__setitem__(0, "x"), ServerError),
        (lambda m: m["input_top_logprobs"][2].pop(), CorruptResponse),  # fewer than k
    ],
)
def test_other_impossible_values(change, error):
    body = copy.deepcopy(_answer())
    change(body["meta_info"])
    with pytest.raises(error, match="meta_info"):
        parse_scores(body, IDS, START, 2, 32, "t")
    with pytest.raises(ServerError, match="meta_info"):
        parse_scores({"meta_info": None}, IDS, START, 2, 32, "t")


def test_the_request_scores_from_the_last_prompt_token():
    payload = score_payload(IDS, START, 4)
    assert payload["sampling_params"]["max_new_tokens"] == 0 and payload["logprob_start_len"] == 1
    assert payload["top_logprobs_num"] == 4 and payload["return_logprob"] and payload["input_ids"] == IDS
    assert not math.isnan(payload["sampling_params"]["temperature"])


BASE = "configs/cpu/default.yaml"
SERVED = [
    "distill.enabled=true",
    "kl.estimator=k3",
    "distill.teacher.source=server",
    "distill.teacher.server.urls=[http://teacher:30000]",
]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["distill.kl.estimator=full"], "distill.kl.estimator=full with distill.teacher.source=server"),
        (["distill.kl.estimator=topk", "kl.estimator=full", "kl.coef=0.01"], "kl.estimator=full with distill.teacher"),
        (["distill.kl.estimator=topk", "rollout.sampling.temperature=0.7"], "rollout.sampling.temperature=0.7"),
        (["distill.teacher.server.urls=[teacher:30000]"], "distill.teacher.server.urls"),
        (["distill.teacher.source=warm_start"], "distill.teacher.server.urls"),
    ],
)
def test_a_served_teacher_refuses_what_it_cannot_give(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("[", r"\[")):
        load_train_config(BASE, [f"train.output_dir={tmp_path}/run", *SERVED, *overrides])


def test_a_served_teacher_with_the_top_k_loads(tmp_path):
    cfg = load_train_config(BASE, [f"train.output_dir={tmp_path}/run", *SERVED, "distill.kl.estimator=topk"])
    assert cfg.distill.teacher.server.urls == ["http://teacher:30000"] and cfg.distill.kl.name.startswith("topk20")


def _vllm_answer(k=2):
    """A vLLM /v1/completions answer with prompt_logprobs=k for IDS: the top-k by rank, the position's own token
    added with its rank where it is not among them."""
    entries = [None]
    for position in range(1, len(IDS)):
        table = {str(20 + r): {"logprob": -0.1 - 0.4 * r, "rank": r + 1, "decoded_token": None} for r in range(k)}
        table[str(IDS[position])] = {"logprob": -3.0, "rank": 9, "decoded_token": None}
        entries.append(table)
    return {"choices": [{"text": "", "prompt_logprobs": entries}]}


def test_a_vllm_answer_is_read_by_rank():
    from megatron_kl.distill.served import parse_vllm_scores

    logprobs, ids, values = parse_vllm_scores(_vllm_answer(), IDS, START, 2, 32, "t")
    assert logprobs == [-3.0, -3.0, -3.0] and ids == [[20, 21]] * 3 and values == [[-0.1, -0.5]] * 3
    assert parse_vllm_scores(_vllm_answer(), IDS, 0, 2, 32, "t")[0] == [-3.0] * 4  # from the first position


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda e: e.pop(), "prompt_logprobs has 4 entries"),
        (lambda e: e[3].pop(str(IDS[3])), r"prompt_logprobs\[3\] lacks the prompt's token"),
        (lambda e: e[2].__setitem__("20", {"logprob": float("nan"), "rank": 1}), r"prompt_logprobs\[2\]"),
        (lambda e: e[4].pop("21"), r"prompt_logprobs\[4\] holds 1 top entries"),
        (lambda e: e[2].__setitem__("21", {"logprob": -0.01, "rank": 2}), r"prompt_logprobs\[2\] is not sorted"),
    ],
)
def test_impossible_vllm_answers_are_refused_naming_the_field(change, field):
    from megatron_kl.distill.served import parse_vllm_scores

    body = _vllm_answer()
    change(body["choices"][0]["prompt_logprobs"])
    with pytest.raises(CorruptResponse, match=field):
        parse_vllm_scores(body, IDS, START, 2, 32, "t")
