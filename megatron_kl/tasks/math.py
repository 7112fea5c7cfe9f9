"""Math word problems with \\boxed{} answers, scored with math-verify.

Loaders read local jsonl or parquet files in the shapes of the common datasets (one file may mix them):

  DAPO-Math-17k  {"prompt": [{"role": "user", "content": Q}, ...], "reward_model": {"ground_truth": A}}
  MATH-500       {"problem": Q, "answer": A}            (AIME and AMC files use the same two fields)
  GSM8K          {"question": Q, "answer": "... #### A"}
  plain          {"question": Q, "answer": A}

A row that fits none of them, has an empty question or answer, or whose prompt exceeds
``max_prompt_tokens`` is skipped and counted; one log line per file names the counts and the first bad
row. Prompts use the tokenizer's chat template (system prompt optional, instruction appended).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import random
import re
import threading
import zlib
from collections import Counter
from pathlib import Path
from typing import Optional

from megatron_kl.config import ConfigError
from megatron_kl.tasks.base import MathConfig, Problem

log = logging.getLogger(__name__)


def normalize_row(row) -> tuple[str, str]:
    """(question, answer) of a row in any supported shape; ValueError naming what is wrong otherwise."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    if isinstance(row.get("prompt"), list) and isinstance(row.get("reward_model"), dict):
        users = [m.get("content") for m in row["prompt"] if isinstance(m, dict) and m.get("role") == "user"]
        question, answer = (users[-1] if users else None), row["reward_model"].get("ground_truth")
    elif "problem" in row:
        question, answer = row.get("problem"), row.get("answer")
    elif "question" in row:
        question, answer = row.get("question"), row.get("answer")
        if isinstance(answer, str) and "####" in answer:
            answer = answer.rsplit("####", 1)[1].replace(",", "")
        elif isinstance(answer, str) and "\n" in answer.strip():  # a GSM8K-style solution without its "#### A"
            raise ValueError("multi-line answer without '#### <final answer>' (a GSM8K solution needs it)")
    else:
        raise ValueError(f"no question field (expected prompt+reward_model, problem or question); keys {sorted(row)}")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("empty or non-text question")
    if len(question) > MAX_QUESTION_CHARS:
        raise ValueError(f"question of {len(question)} characters > {MAX_QUESTION_CHARS} (not tokenized)")
    return question.strip(), _answer_text(answer)


MAX_QUESTION_CHARS = 100_000  # checked before tokenizing: a pathological row must not stall loading


def _answer_text(answer) -> str:
    """The gold answer as text: strings, integers and finite numbers; anything else (lists, objects, NaN,
    booleans, null) is a ValueError rather than a stringified "[1, 2]" or "nan"."""
    if answer is None:
        raise ValueError("empty answer")
    if isinstance(answer, bool):
        raise ValueError(f"answer {answer!r} is not a string or a number")
    if isinstance(answer, int):
        return str(answer)
    if isinstance(answer, float):
        if not math.isfinite(answer):
            raise ValueError(f"answer {answer!r} is not a finite number")
        return repr(answer) if answer != int(answer) else str(int(answer))
    if not isinstance(answer, str):
        raise ValueError(f"answer of type {type(answer).__name__} ({str(answer)[:40]}) is not a string or a number")
    if not answer.strip():
        raise ValueError("empty answer")
    if answer.count("{") != answer.count("}"):
        raise ValueError(f"answer {answer[:40]!r} has unbalanced braces (it can never verify)")
    return answer.strip()


def read_rows(path: str, section: str = "task.math") -> list:
    """Rows of a jsonl (optionally gzip-compressed: ``.jsonl.gz``) or parquet file; a file that is not
    UTF-8 text is a ConfigError naming it and the first bad line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{section} file {path} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow's errors for damaged files are of many kinds
            raise ConfigError(
                f"{section} file {path} is not a readable parquet file ({type(err).__name__}: "
                f"{str(err)[:200]}); re-export it"
            ) from None
    data = p.read_bytes()
    if data[:2] == b"\x1f\x8b":  # gzip, whatever the name
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError, zlib.error) as err:
            raise ConfigError(
                f"{section} file {path} is a damaged gzip file ({type(err).__name__}: {err or 'cut short'}"
                "); compress it again or give the uncompressed .jsonl"
            ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{section} file {path} is not UTF-8 text (line {line}, byte {err.start}: {err.reason}); "
            "convert it to UTF-8 jsonl or parquet"
        ) from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            rows.append(ValueError(f"line {number}: invalid JSON ({err.msg})"))
        except RecursionError:  # nesting deeper than Python's parser recursion (a hostile or broken row)
            rows.append(ValueError(f"line {number}: JSON nested too deeply to read"))
    return rows


def score_answer(gold: str, response: str) -> float:
    """1.0 when math-verify finds the response's final answer equal to ``gold``."""
    from math_verify import parse, verify

    # math-verify's own timeouts use signal.alarm, which works in the main thread only; elsewhere (the reward
    # workers) they are off and the caller's per-call timeout (reward.timeout_s) bounds the call
    limits = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
    if limits:  # it warns at every call that its own timeout is off: said once here instead
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    gold_parsed = parse(f"\\boxed{{{gold}}}", **limits)
    predicted = parse(response, **limits)
    if not gold_parsed or not predicted:
        return 0.0
    try:
        return float(verify(gold_parsed, predicted, **({"timeout_seconds": None} if limits else {})))
    except Exception:  # noqa: BLE001 - math-verify raises on some malformed expressions: no reward
        return 0.0


def normalized_question(text: str) -> str:
    """A question as overlap checks compare it: lower case, no whitespace."""
    return re.sub(r"\s+", "", text.lower())


def check_overlap(splits: dict, groups: dict[str, list[str]], mode: str, section: str) -> dict[str, int]:
    """Evaluation prompts also in the training split (compared by :func:`normalized_question`), per evaluation split;
    ``mode`` (``<section>.eval_overlap``): refuse (ConfigError naming each split and its count), drop (left out of
    ``splits``' evaluation splits, in place) or report (kept, a warning)."""
    trained = {normalized_question(p.prompt_text) for p in splits["train"]}
    per_file = [k for group, names in groups.items() for k in names]
    overlap = {k: sum(normalized_question(p.prompt_text) in trained for p in splits[k]) for k in per_file}
    overlap = {k: n for k, n in overlap.items() if n}
    if not overlap:
        return {}
    counts = ", ".join(f"{k}: {n} of {len(splits[k])}" for k, n in overlap.items())
    files = section + ".train_files"
    if mode == "refuse":
        raise ConfigError(
            f"{section}: evaluation questions also in {files} ({counts}): their scores "
            "would include trained-on questions. Remove them from the files, or set "
            f"{section}.eval_overlap=drop (leave them out of the scores) or report (keep them)"
        )
    if mode == "drop":
        for key in list(splits):
            if key != "train":
                splits[key] = [p for p in splits[key] if normalized_question(p.prompt_text) not in trained]
        log.warning(
            "%s: left %s evaluation question(s) also in the training files out of the scores (%s)",
            section,
            sum(overlap.values()),
            counts,
        )
        emptied = [k for k in overlap if not splits[k]]
        if emptied:
            raise ConfigError(
                f"{section}.eval_overlap=drop leaves no question in {emptied}: every one of them is in {files}"
            )
    else:
        log.warning(
            "%s: evaluation questions also in the training files are scored (%s; %s.eval_overlap=report)",
            section,
            counts,
            section,
        )
    return overlap


def _file_names(files: list[str]) -> dict[str, str]:
    """A short unique name per file: its stem (math500, aime2024, ...), numbered when stems repeat."""
    names: dict[str, str] = {}
    for path in files:
        stem = Path(path).name.split(".")[0]
        name, n = stem, 2
        while name in names:
            name, n = f"{stem}{n}", n + 1
        names[name] = path
    return names


class FileSplits:
    """The Task protocol's reading side for tasks whose splits are loaded rows: ``self.splits`` (name -> problems),
    ``self.groups`` (reported split -> its files' splits) and ``self.seed``; the training split is drawn in a seeded
    order reshuffled every epoch."""

    splits: dict
    groups: dict
    seed: int

    def eval_groups(self) -> dict[str, list[str]]:
        return dict(self.groups)

    def num_problems(self, split: str) -> Optional[int]:
        return None if split == "train" else len(self.splits[split])

    def longest_prompt_tokens(self) -> int:
        return max((len(p.prompt_ids) for rows in self.splits.values() for p in rows), default=0)

    def problem(self, split: str, index: int) -> Problem:
        rows = self.splits[split]
        if split != "train":
            return rows[index]
        epoch, position = divmod(index, len(rows))
        order = list(range(len(rows)))
        random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
        return rows[order[position]]


class MathTask(FileSplits):
    default_reward = "math_verify"  # score() as a reward function (megatron_kl.rewards.builtin)

    def __init__(self, cfg: MathConfig, seed: int = 0, tokenizer=None):
        if not cfg.train_files:
            raise ConfigError("task.math.train_files is empty: give at least one jsonl/parquet file")
        if tokenizer is None:
            if not cfg.tokenizer:
                raise ConfigError("task.math.tokenizer is empty: give an HF tokenizer path or name")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        self.cfg, self.seed = cfg, seed
        self.hf_tokenizer = tokenizer
        self.tokenizer = _TokenizerView(tokenizer)
        self.skipped: Counter = Counter()
        self.splits = {"train": self._load(cfg.train_files)}
        self.groups: dict[str, list[str]] = {}
        for group, files in (("eval", cfg.eval_files), ("ood", cfg.ood_files)):
            per_file = {f"{group}:{name}": self._load([path]) for name, path in _file_names(files).items()}
            self.splits[group] = [p for problems in per_file.values() for p in problems]
            if len(per_file) > 1:  # one split per benchmark file, reported next to the merged one
                self.splits.update(per_file)
                self.groups[group] = list(per_file)
            else:
                self.groups[group] = [group]
        if not self.splits["train"]:
            raise ConfigError(f"task.math.train_files {cfg.train_files} hold no usable rows (see the log)")
        self.overlap = self._check_overlap()
        for group, files in (("eval", cfg.eval_files), ("ood", cfg.ood_files)):
            for name, path in _file_names(files).items():
                key = f"{group}:{name}" if len(files) > 1 else group
                if not self.splits[key]:  # would report pass@1 = 0.0 for a benchmark that was never run
                    raise ConfigError(f"task.math.{group}_files: {path} holds no usable rows (see the log)")

    def _check_overlap(self) -> dict[str, int]:
        """Evaluation questions also in the training files, per eval / OOD split (task.math.eval_overlap)."""
        return check_overlap(self.splits, self.groups, self.cfg.eval_overlap, "task.math")

    def _prompt_ids(self, question: str) -> list[int]:
        messages = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        messages.append({"role": "user", "content": f"{question} {self.cfg.instruction}".strip()})
        ids = self.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _load(self, files: list[str]) -> list[Problem]:
        """Usable problems of ``files``; malformed, unverifiable and duplicate rows (a question seen before in
        these files) are skipped and counted per file."""
        problems, seen = [], set()
        for path in files:
            bad, first_error = Counter(), None
            for index, row in enumerate(read_rows(path)):
                try:
                    if isinstance(row, Exception):
                        raise row
                    question, answer = normalize_row(row)
                    ids = self._prompt_ids(question)
                    if len(ids) > self.cfg.max_prompt_tokens:
                        raise ValueError(f"prompt has {len(ids)} tokens > task.math.max_prompt_tokens")
                    if question in seen:
                        raise ValueError("duplicate question (kept its first row)")
                    seen.add(question)
                except ValueError as err:
                    reason = str(err).split(" (")[0].split(":")[0][:60]
                    bad[reason] += 1
                    first_error = first_error or f"row {index}: {err}"
                    continue
                problems.append(Problem(prompt_ids=ids, answer=answer, prompt_text=question))
            if bad:
                self.skipped.update({path: sum(bad.values())})
                log.warning("%s: skipped %d row(s) %s; first: %s", path, sum(bad.values()), dict(bad), first_error)
        return problems

    def score(self, problem: Problem, response_ids: list[int]) -> float:
        return score_answer(problem.answer, self.tokenizer.decode(response_ids))


class _TokenizerView:
    """The Tokenizer protocol over an HF tokenizer."""

    def __init__(self, hf):
        self.hf = hf
        self.vocab_size = len(hf)
        self.eos_id = hf.eos_token_id
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)
