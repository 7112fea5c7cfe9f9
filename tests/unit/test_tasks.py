"""Tasks: arithmetic generation/scoring, math row shapes, malformed rows, math-verify scoring, chat template."""

import json

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.rollout.engine import EngineBase
from megatron_kl.tasks.arithmetic import ArithmeticTask, CharTokenizer
from megatron_kl.tasks.base import ArithmeticConfig, MathConfig, TaskConfig
from megatron_kl.tasks.math import MathTask, normalize_row, score_answer


def _evaluate(text: str) -> int:
    for op in "+-*":
        left, sep, right = text[:-1].partition(op)
        if sep and left:
            return {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[op](int(left), int(right))
    raise AssertionError(text)


def test_arithmetic_problems_are_deterministic_and_scored_exactly():
    task = ArithmeticTask(ArithmeticConfig(min_digits=1, max_digits=2, operators="+-"), seed=3)
    tok = task.tokenizer
    for i in range(50):
        p = task.problem("train", i)
        assert p == task.problem("train", i)
        assert str(_evaluate(p.prompt_text)) == p.answer
        assert tok.decode(p.prompt_ids) == p.prompt_text
        assert task.score(p, task.target_ids(p)) == 1.0
        assert task.score(p, task.target_ids(p)[:-1]) == 0.0  # no EOS: not finished
        assert task.score(p, tok.encode(p.answer + "1") + [tok.eos_id]) == 0.0
    assert task.problem("train", 0) != ArithmeticTask(ArithmeticConfig(), seed=4).problem("train", 0)


def test_arithmetic_ood_split_has_longer_operands_and_other_operators():
    task = ArithmeticTask(
        ArithmeticConfig(max_digits=2, operators="+", ood_min_digits=3, ood_max_digits=3, ood_operators="*"),
        eval_size=20,
    )
    for i in range(20):
        text = task.problem("ood", i).prompt_text
        assert "*" in text and len(text.split("*")[0]) == 3
        assert "*" not in task.problem("train", i).prompt_text
    assert task.num_problems("ood") == 20 and task.num_problems("train") is None


def test_arithmetic_held_out_region_is_the_ood_split_and_never_in_training():
    task = ArithmeticTask(
        ArithmeticConfig(max_digits=2, operators="+-", held_out_min_operand=10, held_out_max_operand=29), eval_size=200
    )

    def operands(problem):
        a, b = problem.prompt_text.rstrip("=").replace("-", "+").split("+")
        return int(a), int(b)

    inside = lambda a, b: 10 <= a <= 29 and 10 <= b <= 29  # noqa: E731
    for i in range(400):
        for split in ("train", "eval"):
            p = task.problem(split, i)
            assert not inside(*operands(p)), p.prompt_text
            assert str(_evaluate(p.prompt_text)) == p.answer
    ood = [task.problem("ood", i) for i in range(200)]
    assert all(inside(*operands(p)) for p in ood)
    assert {p.prompt_text[2] for p in ood} == {"+", "-"}  # the in-domain operators
    assert all(str(_evaluate(p.prompt_text)) == p.answer for p in ood)
    # the region's default top is the largest max_digits-digit number
    top = ArithmeticTask(ArithmeticConfig(max_digits=2, operators="+", held_out_min_operand=90))
    assert all(min(operands(top.problem("ood", i))) >= 90 for i in range(50))


def test_arithmetic_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="operators"):
        ArithmeticTask(ArithmeticConfig(operators="/"))
    with pytest.raises(ConfigError, match="ood_min_digits"):
        ArithmeticTask(ArithmeticConfig(ood_min_digits=4, ood_max_digits=3))
    with pytest.raises(ConfigError, match="held_out_min_operand"):
        ArithmeticTask(ArithmeticConfig(max_digits=2, held_out_min_operand=30, held_out_max_operand=20))
    with pytest.raises(ConfigError, match="held_out_min_operand"):
        ArithmeticTask(ArithmeticConfig(max_digits=2, held_out_min_operand=100))
    with pytest.raises(ConfigError, match="task.name"):
        TaskConfig(name="chess")
    with pytest.raises(ValueError, match="vocabulary"):
        CharTokenizer().encode("1/2")


@pytest.mark.parametrize(
    "row, expected",
    [
        (
            {"prompt": [{"role": "user", "content": "What is 1+1?"}], "reward_model": {"ground_truth": "2"}},
            ("What is 1+1?", "2"),
        ),
        ({"problem": "Compute $x$.", "answer": "\\frac{1}{2}", "solution": "..."}, ("Compute $x$.", "\\frac{1}{2}")),
        ({"question": "Tom has 3 apples...", "answer": "He has 3+4=7.\n#### 1,007"}, ("Tom has 3 apples...", "1007")),
        ({"question": "AIME style", "answer": 204}, ("AIME style", "204")),
    ],
)
def test_row_shapes(row, expected):
    assert normalize_row(row) == expected


@pytest.mark.parametrize(
    "row, message",
    [
        ({"text": "no question"}, "no question field"),
        ({"problem": "", "answer": "1"}, "empty or non-text question"),
        ({"question": "Q", "answer": None}, "empty answer"),
        (["not", "a", "dict"], "not an object"),
    ],
)
def test_malformed_rows_raise_naming_the_problem(row, message):
    with pytest.raises(ValueError, match=message):
        normalize_row(row)


def test_math_verify_scoring():
    assert score_answer("\\frac{1}{2}", "... so the answer is \\boxed{0.5}.") == 1.0
    assert score_answer("42", "\\boxed{41}") == 0.0
    assert score_answer("42", "no answer at all") == 0.0


def _tiny_hf_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["What is 1+1? The answer is \\boxed{2}. Tom has apples."] * 10,
        vocab_size=300,
        special_tokens=["<eos>", "<pad>"],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<eos>",
        pad_token="<pad>",
        chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}",
    )


def test_math_task_loads_mixed_files_skips_and_counts_malformed_rows(tmp_path, caplog):
    rows = [
        {"prompt": [{"role": "user", "content": "What is 1+1?"}], "reward_model": {"ground_truth": "2"}},
        {"problem": "What is 2+2?", "answer": "4"},
        {"text": "bad"},
        {"question": "Q", "answer": ""},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"problem": "What is 3+3?", "answer": "6"}]), tmp_path / "eval.parquet")
    with caplog.at_level("WARNING"):
        task = MathTask(
            MathConfig(train_files=[str(path)], eval_files=[str(tmp_path / "eval.parquet")], system_prompt="Be brief."),
            tokenizer=_tiny_hf_tokenizer(),
        )
    assert len(task.splits["train"]) == 2 and len(task.splits["eval"]) == 1
    assert task.skipped[str(path)] == 3
    assert "skipped 3 row(s)" in caplog.text and "row 2" in caplog.text
    first = task.problem("train", 0)
    text = task.hf_tokenizer.decode(first.prompt_ids)
    assert text.startswith("[system] Be brief.") and text.endswith("[assistant] ") and "\\boxed{}" in text
    answer_ids = task.tokenizer.encode("The answer is \\boxed{%s}." % first.answer)
    assert task.score(first, answer_ids) == 1.0
    # every epoch visits every row once, in a seeded order
    assert sorted(task.problem("train", i).answer for i in range(2, 4)) == ["2", "4"]


def test_math_task_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="train_files"):
        MathTask(MathConfig(), tokenizer=_tiny_hf_tokenizer())
    with pytest.raises(ConfigError, match="does not exist"):
        MathTask(MathConfig(train_files=[str(tmp_path / "missing.jsonl")]), tokenizer=_tiny_hf_tokenizer())


def test_math_task_reports_each_benchmark_file_and_the_weighted_merge(tmp_path):
    """Several eval files (MATH-500, AIME, ...): one split per file plus the merged split, whose scores are
    the problem-weighted means of the files' (what evaluate_all reports)."""
    from megatron_kl.rollout.engine import Completion, SamplingConfig
    from megatron_kl.train.evaluate import evaluate_all

    def write(name, answers):
        (tmp_path / name).write_text("\n".join(json.dumps({"problem": f"Q{a}", "answer": str(a)}) for a in answers))
        return str(tmp_path / name)

    train = write("train.jsonl", [9])
    task = MathTask(
        MathConfig(
            train_files=[train],
            eval_files=[write("math500.jsonl", [1, 2, 3]), write("aime2024.jsonl", [4])],
            ood_files=[write("gsm8k.jsonl", [5, 6])],
        ),
        tokenizer=_tiny_hf_tokenizer(),
    )
    assert task.eval_groups() == {"eval": ["eval:math500", "eval:aime2024"], "ood": ["ood"]}
    assert task.num_problems("eval") == 4 and task.num_problems("eval:aime2024") == 1

    class Oracle(EngineBase):  # answers the math500 problems right, everything else wrong
        def generate(self, prompts, sampling, seed=None):
            out = []
            for prompt in prompts:
                question = task.hf_tokenizer.decode(prompt)
                right = any(f"Q{a} " in question for a in (1, 2, 3))
                text = "\\boxed{%s}" % (question.split("Q")[1].split()[0] if right else "0")
                ids = task.tokenizer.encode(text)
                out.append(Completion(list(prompt), ids, [0.0] * len(ids), "stop", 0))
            return out

    metrics = evaluate_all(Oracle(), task, SamplingConfig(), k=2, temperature=1.0, seed=0)
    assert metrics["eval/id:math500/pass@1"] == 1.0 and metrics["eval/id:aime2024/pass@1"] == 0.0
    assert metrics["eval/id/pass@1"] == pytest.approx(0.75) and metrics["eval/id/mean@2"] == pytest.approx(0.75)
    assert metrics["eval/ood/pass@1"] == 0.0 and "eval/ood:gsm8k/pass@1" not in metrics
    # no OOD files configured: nothing reported for ood (not a pass@1 of 0.0 for a benchmark never run)
    no_ood = MathTask(
        MathConfig(train_files=[train], eval_files=[str(tmp_path / "math500.jsonl")]), tokenizer=_tiny_hf_tokenizer()
    )
    metrics = evaluate_all(Oracle(), no_ood, SamplingConfig(), k=2, temperature=1.0, seed=0)
    assert metrics["eval/id/pass@1"] == 1.0 and not any(key.startswith("eval/ood") for key in metrics)


def test_data_errors_name_the_file_and_row(tmp_path, caplog):
    """Non-UTF-8 files, gzip files, GSM8K solutions without '####', non-string answers, oversized rows and
    empty eval files: each a clear error or a counted, warned skip naming the file and row."""
    import gzip

    from megatron_kl.config import ConfigError

    good = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": 4}]
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(json.dumps(good[0]).encode() + b"\n" + '{"problem": "caf\xe9", "answer": "1"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.jsonl is not UTF-8 text \(line 2"):
        MathTask(MathConfig(train_files=[str(latin)]), tokenizer=_tiny_hf_tokenizer())

    packed = tmp_path / "train.jsonl.gz"  # gzip is read transparently
    packed.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in good).encode()))
    rows = [
        {"question": "Tom has 2 apples.", "answer": "He has 2.\nSo 2 apples."},  # GSM8K without ####
        {"problem": "Q1", "answer": [1, 2]},
        {"problem": "Q2", "answer": float("nan")},
        {"problem": "Q3", "answer": None},
        {"problem": "x" * 2_000_000, "answer": "1"},
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level("WARNING"):
        task = MathTask(MathConfig(train_files=[str(packed), str(bad)]), tokenizer=_tiny_hf_tokenizer())
    assert sorted(p.answer for p in task.splits["train"]) == ["2", "4"] and task.skipped[str(bad)] == 5
    assert "bad.jsonl: skipped 5 row(s)" in caplog.text and "row 0: multi-line answer" in caplog.text

    empty = tmp_path / "aime.jsonl"
    empty.write_text(json.dumps({"problem": "Q", "answer": [1]}) + "\n")
    with pytest.raises(ConfigError, match="task.math.eval_files: .*aime.jsonl holds no usable rows"):
        MathTask(MathConfig(train_files=[str(packed)], eval_files=[str(empty)]), tokenizer=_tiny_hf_tokenizer())


def test_malformed_config_yaml_is_a_one_line_config_error(tmp_path):
    import subprocess
    import sys

    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  steps: [1, 2\nkl: {coef: 0.1}\n")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "train", "--config", str(broken)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"config file {broken} is not valid YAML at line" in done.stderr


def test_damaged_gzip_unverifiable_answers_and_duplicates_are_named(tmp_path, caplog):
    """A gzip file cut short is a ConfigError naming it; answers that can never verify (unbalanced braces, as a
    cut-off \\boxed{) and repeated questions are skipped and counted per file, the first row named."""
    import gzip

    from megatron_kl.config import ConfigError

    good = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": "\\frac{8}{2}"}]
    packed = gzip.compress("\n".join(json.dumps(r) for r in good).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed[: len(packed) - 9])
    with pytest.raises(ConfigError, match=r"cut.jsonl.gz is a damaged gzip file"):
        MathTask(MathConfig(train_files=[str(cut)]), tokenizer=_tiny_hf_tokenizer())

    rows = [*good, {"problem": "What is 3+3?", "answer": "\\boxed{6"}, {"problem": "What is 1+1?", "answer": "2"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    again = tmp_path / "again.jsonl"
    again.write_text(json.dumps(good[1]) + "\n" + json.dumps({"problem": "What is 5+5?", "answer": "10"}))
    with caplog.at_level("WARNING"):
        task = MathTask(MathConfig(train_files=[str(data), str(again)]), tokenizer=_tiny_hf_tokenizer())
    assert sorted(p.answer for p in task.splits["train"]) == ["10", "2", "\\frac{8}{2}"]
    assert task.skipped[str(data)] == 2 and task.skipped[str(again)] == 1
    assert (
        "rows.jsonl: skipped 2 row(s)" in caplog.text
        and "row 2: answer '\\\\boxed{6' has unbalanced braces" in caplog.text
    )
    assert "again.jsonl: skipped 1 row(s)" in caplog.text and "row 0: duplicate question" in caplog.text


def test_evaluation_questions_also_trained_on_are_refused_dropped_or_reported_per_file(tmp_path, caplog):
    def write(name, questions):
        (tmp_path / name).write_text("\n".join(json.dumps({"problem": q, "answer": "1"}) for q in questions))
        return str(tmp_path / name)

    train = write("train.jsonl", ["What is 1+1?", "Solve x = 3", "Q unique"])
    files = dict(
        eval_files=[write("math500.jsonl", ["what is 1 + 1?", "Other"]), write("aime.jsonl", ["A", "B"])],
        ood_files=[write("gsm8k.jsonl", ["SOLVE  x=3", "C", "D"])],
    )
    with pytest.raises(ConfigError, match=r"eval:math500: 1 of 2.*ood: 1 of 3.*eval_overlap=drop"):
        MathTask(MathConfig(train_files=[train], **files), tokenizer=_tiny_hf_tokenizer())
    with caplog.at_level("WARNING"):
        dropped = MathTask(
            MathConfig(train_files=[train], eval_overlap="drop", **files), tokenizer=_tiny_hf_tokenizer()
        )
    assert dropped.overlap == {"eval:math500": 1, "ood": 1} and "left 2 evaluation question(s)" in caplog.text
    assert [p.prompt_text for p in dropped.splits["eval:math500"]] == ["Other"] and len(dropped.splits["eval"]) == 3
    assert [p.prompt_text for p in dropped.splits["ood"]] == ["C", "D"] and len(dropped.splits["train"]) == 3
    reported = MathTask(MathConfig(train_files=[train], eval_overlap="report", **files), tokenizer=_tiny_hf_tokenizer())
    assert reported.overlap == {"eval:math500": 1, "ood": 1} and len(reported.splits["eval:math500"]) == 2
    clean = MathTask(
        MathConfig(train_files=[train], eval_files=[files["eval_files"][1]]), tokenizer=_tiny_hf_tokenizer()
    )
    assert clean.overlap == {}
    with pytest.raises(ConfigError, match="leaves no question"):
        MathTask(
            MathConfig(train_files=[train], eval_overlap="drop", eval_files=[write("same.jsonl", ["Q unique"])]),
            tokenizer=_tiny_hf_tokenizer(),
        )


def test_a_row_nested_too_deeply_is_a_counted_skip_naming_its_line(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    path.write_text(
        json.dumps({"problem": "What is 1+1?", "answer": "2"})
        + "\n"
        + "[" * 200_000
        + "]" * 200_000
        + "\n"
        + json.dumps({"problem": "What is 2+2?", "answer": "4"})
        + "\n"
    )
    with caplog.at_level("WARNING"):
        task = MathTask(MathConfig(train_files=[str(path)]), tokenizer=_tiny_hf_tokenizer())
    assert len(task.splits["train"]) == 2 and task.skipped[str(path)] == 1
    assert "line 2: JSON nested too deeply" in caplog.text and str(path) in caplog.text
