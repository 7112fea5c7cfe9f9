"""task.name=dataset: your own rows from jsonl, parquet, a `datasets` directory (Dataset and DatasetDict split) or a
directory of files, with named columns; extra columns reach the rewards; every bad row refused naming file and row."""

import gzip
import json

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.tasks.arithmetic import CharTokenizer
from megatron_kl.tasks.base import DatasetConfig
from megatron_kl.tasks.dataset import DatasetTask, TaskContext
from tests.unit.test_tasks import _tiny_hf_tokenizer

ROWS = [
    {"story": f"Tom has {i} apples and gets 1 more.", "solution": i + 1, "unit": "apples", "level": i % 3}
    for i in range(6)
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task(tmp_path, train=None, **overrides):
    settings = {
        "train_files": [train or _jsonl(tmp_path / "train.jsonl", ROWS)],
        "prompt_column": "story",
        "answer_column": "solution",
        "tokenizer": "chars",
        **overrides,
    }
    return DatasetTask(DatasetConfig(**settings), context=TaskContext(prompt_token_limit=80))


def test_named_columns_and_fields_reach_the_problem(tmp_path):
    task = _task(tmp_path)
    problems = [task.problem("train", i) for i in range(6)]
    assert sorted(p.answer for p in problems) == [str(i + 1) for i in range(6)]
    p = next(p for p in problems if p.answer == "3")
    assert p.prompt_text == "Tom has 2 apples and gets 1 more." and p.fields == {"unit": "apples", "level": 2}
    tok = task.tokenizer
    assert isinstance(tok, CharTokenizer) and p.prompt_ids == [tok.bos_id] + tok.encode(p.prompt_text)
    assert tok.decode(tok.encode("Ab 1?\n") + [tok.eos_id]) == "Ab 1?\n"
    assert task.target_ids(p) == tok.encode("3") + [tok.eos_id]
    assert {task.problem("train", 6 + i).answer for i in range(6)} == {str(i + 1) for i in range(6)}  # next epoch


def test_every_source_format_reads_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = [(p.prompt_text, p.answer, p.fields) for p in _task(tmp_path).splits["train"]]
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    gz = tmp_path / "train.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "train.jsonl").read_bytes()))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(str(tmp_path / "hfdict"))
    shards = tmp_path / "shards"
    shards.mkdir()
    _jsonl(shards / "a.jsonl", ROWS[:3])
    pq.write_table(pa.Table.from_pylist(ROWS[3:]), shards / "b.parquet")
    for source in (tmp_path / "train.parquet", gz, tmp_path / "hf", f"{tmp_path / 'hfdict'}:train", shards):
        got = [(p.prompt_text, p.answer, p.fields) for p in _task(tmp_path, str(source)).splits["train"]]
        assert got == expected, source
    with pytest.raises(ConfigError, match=r"DatasetDict with splits \['test', 'train'\]; name one"):
        _task(tmp_path, str(tmp_path / "hfdict"))


@pytest.mark.parametrize(
    "row, settings, says",
    [
        (
            {"question": "x", "solution": 1},
            {},
            r"row 1 has no column 'story' \(columns: \['question', 'solution'\]\); set "
            r"task.dataset.prompt_column",
        ),
        ({"story": "x"}, {}, r"row 1 has no column 'solution' .*or '' when the data has no answers"),
        ({"story": "", "solution": 1}, {}, r"row 1: the prompt '' is empty or not text"),
        ({"story": "é", "solution": 1}, {}, r"row 1: character .é. is not in the .chars. tokenizer"),
        ({"story": "x" * 200, "solution": 1}, {}, r"row 1: the prompt has 201 tokens, more than the 80"),
        (
            {"story": "x" * 40, "solution": 1},
            {"max_prompt_tokens": 36},
            r"row 1: the prompt has 41 tokens, more than the 36",
        ),
        ({"story": "x", "solution": True}, {}, r"row 1: answer True is not text or a number"),
        (
            {"story": [{"role": "user", "content": "hi"}], "solution": 1},
            {},
            r"row 1: the prompt is chat messages but no "
            r"chat template applies",
        ),
    ],
)
def test_a_bad_row_is_refused_naming_the_file_and_the_row(tmp_path, row, settings, says):
    path = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(ConfigError, match=rf"^task.dataset: .*bad\.jsonl {says}"):
        _task(tmp_path, path, **settings)


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl row 1: line 2: invalid JSON"):
        _task(tmp_path, str(path))


def test_evaluation_rows_also_trained_on_are_refused_dropped_or_reported(tmp_path):
    _jsonl(tmp_path / "eval.jsonl", [ROWS[0], {**ROWS[1], "story": "A new  question?"}])
    with pytest.raises(
        ConfigError,
        match=r"task.dataset: evaluation questions also in task.dataset.train_files "
        r"\(eval: 1 of 2\)",
    ):
        _task(tmp_path, eval_files=[str(tmp_path / "eval.jsonl")])
    task = _task(tmp_path, eval_files=[str(tmp_path / "eval.jsonl")], eval_overlap="drop")
    assert task.num_problems("eval") == 1 and task.problem("eval", 0).prompt_text == "A new  question?"
    assert _task(tmp_path, eval_files=[str(tmp_path / "eval.jsonl")], eval_overlap="report").num_problems("eval") == 2


def test_the_chat_template_system_prompt_and_instruction(tmp_path):
    tokenizer = _tiny_hf_tokenizer()
    rows = [
        {"story": "Tom has apples.", "solution": 1},
        {"story": [{"role": "user", "content": "What is 1+1?"}], "solution": 2},
    ]
    cfg = DatasetConfig(
        train_files=[_jsonl(tmp_path / "t.jsonl", rows)],
        prompt_column="story",
        answer_column="solution",
        system_prompt="Be brief.",
        instruction="Answer in \\boxed{}.",
    )
    task = DatasetTask(cfg, context=TaskContext(prompt_token_limit=500), tokenizer=tokenizer)
    texts = sorted(tokenizer.decode(p.prompt_ids) for p in task.splits["train"])
    assert texts == [
        "[system] Be brief.\n[user] Tom has apples. Answer in \\boxed{}.\n[assistant] ",
        "[system] Be brief.\n[user] What is 1+1? Answer in \\boxed{}.\n[assistant] ",
    ]
    assert sorted(p.prompt_text for p in task.splits["train"]) == ["Tom has apples.", "What is 1+1?"]
    plain = DatasetTask(
        DatasetConfig(
            **{**cfg.__dict__, "train_files": [_jsonl(tmp_path / "p.jsonl", rows[:1])], "chat_template": "off"}
        ),
        context=TaskContext(),
        tokenizer=tokenizer,
    )
    assert tokenizer.decode(plain.splits["train"][0].prompt_ids) == "Tom has apples. Answer in \\boxed{}."


def test_without_answers_and_without_a_tokenizer(tmp_path):
    task = _task(tmp_path, answer_column="")
    assert {p.answer for p in task.splits["train"]} == {""}
    assert task.splits["train"][0].fields["solution"] in range(1, 7)
    with pytest.raises(ConfigError, match="warm_start trains on the answers"):
        task.target_ids(task.splits["train"][0])
    with pytest.raises(ConfigError, match="task.dataset.tokenizer is empty and there is no init.hf_checkpoint"):
        _task(tmp_path, tokenizer="")
    with pytest.raises(ConfigError, match="task.dataset.train_files is empty"):
        DatasetTask(DatasetConfig())
