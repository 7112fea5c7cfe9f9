"""Your own prompts from files (``task.name=dataset``, the ``task.dataset`` section): jsonl / jsonl.gz / parquet, a
Hugging Face ``datasets`` directory, or a directory of such files; the prompt and answer columns named in the config,
every other column passed to the reward functions as ``Problem.fields``.

Prompts go through the tokenizer's chat template when it has one (``chat_template``), with an optional system prompt
and an instruction appended. Rows are checked at start, not when first drawn: a row without the prompt column (or the
answer column, when one is named), a prompt that is not text or chat messages, or a prompt longer than the limit (the
model's positions minus ``rollout.sampling.max_new_tokens``, or ``max_prompt_tokens``) is a ConfigError naming the file,
the row and the fix. Evaluation prompts also in the training files are refused, dropped or reported
(``eval_overlap``). The training split is drawn in a seeded order, reshuffled every epoch (as the math task's).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_kl.config import ConfigError
from megatron_kl.tasks.arithmetic import CharTokenizer
from megatron_kl.tasks.base import DatasetConfig, Problem
from megatron_kl.tasks.math import FileSplits, _file_names, _TokenizerView, check_overlap, read_rows

log = logging.getLogger(__name__)
SECTION = "task.dataset"


@dataclass(frozen=True)
class TaskContext:
    """What a task needs from outside its section: the init HF checkpoint (its tokenizer is the default) and the
    longest prompt the model can take (its positions minus the response budget)."""

    hf_checkpoint: Optional[str] = None
    prompt_token_limit: Optional[int] = None


def printable_tokenizer() -> CharTokenizer:
    """``tokenizer: chars``: one token per printable ASCII character and newline, after ``<pad> <bos> <eos>`` (99
    ids): for tiny models trained from scratch on a CPU."""
    return CharTokenizer(
        "\n" + "".join(chr(c) for c in range(32, 127)), "the 'chars' tokenizer (printable ASCII and newline)"
    )


def dataset_rows(path: str) -> list:
    """The rows of one data source: a file (jsonl, jsonl.gz, parquet), an HF ``datasets`` directory (``DIR:split`` for a
    DatasetDict's split) or a directory of parquet / jsonl files (read in name order)."""
    source, split = Path(path), None
    if not source.exists() and ":" in path:
        head, split = path.rsplit(":", 1)
        source = Path(head)
    if source.is_file():
        return read_rows(str(source), SECTION)
    if not source.is_dir():
        raise ConfigError(f"{SECTION} file {path} does not exist")
    if (source / "dataset_info.json").is_file() or (source / "dataset_dict.json").is_file():
        return _hf_rows(source, split, path)
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.name.endswith((".parquet", ".jsonl", ".jsonl.gz")))
    if not files:
        raise ConfigError(
            f"{SECTION} directory {path} holds no parquet / jsonl file and is not a `datasets` directory (save_to_disk)"
        )
    return [row for f in files for row in read_rows(str(f), SECTION)]


def _hf_rows(directory: Path, split: Optional[str], path: str) -> list:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{SECTION}: {path} is a Hugging Face `datasets` directory; install the reader: "
            "pip install 'megatron-kl[data]' (or pip install datasets)"
        ) from None
    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None or split not in loaded:
            raise ConfigError(
                f"{SECTION}: {path} is a DatasetDict with splits {sorted(loaded)}; name one as "
                f"{directory}:<split>, e.g. {directory}:{sorted(loaded)[0]}"
            )
        loaded = loaded[split]
    return loaded.to_list()


class DatasetTask(FileSplits):
    default_reward = None  # reward.functions names the job's rewards

    def __init__(self, cfg: DatasetConfig, seed: int = 0, context: TaskContext = TaskContext(), tokenizer=None):
        if not cfg.train_files:
            raise ConfigError(
                f"{SECTION}.train_files is empty: give at least one jsonl / parquet file or `datasets` directory"
            )
        self.cfg, self.seed = cfg, seed
        self.hf_tokenizer = None
        if tokenizer is not None:
            self.hf_tokenizer, self.tokenizer = tokenizer, _TokenizerView(tokenizer)
        elif cfg.tokenizer == "chars":
            self.tokenizer = printable_tokenizer()
        else:
            name = cfg.tokenizer or context.hf_checkpoint
            if not name:
                raise ConfigError(
                    f"{SECTION}.tokenizer is empty and there is no init.hf_checkpoint to take it from: "
                    "give an HF tokenizer path or name, or 'chars' for a character model"
                )
            from transformers import AutoTokenizer

            self.hf_tokenizer = AutoTokenizer.from_pretrained(name)
            self.tokenizer = _TokenizerView(self.hf_tokenizer)
        has_template = bool(getattr(self.hf_tokenizer, "chat_template", None))
        if cfg.chat_template == "on" and not has_template:
            raise ConfigError(
                f"{SECTION}.chat_template=on but the tokenizer ({cfg.tokenizer or context.hf_checkpoint}) "
                "has no chat template: set it to auto or off"
            )
        self.use_template = has_template and cfg.chat_template != "off"
        self.limit = cfg.max_prompt_tokens or context.prompt_token_limit
        self.splits = {"train": self._load(cfg.train_files, require_answer=True)}
        self.groups: dict[str, list[str]] = {}
        for group, files in (("eval", cfg.eval_files), ("ood", cfg.ood_files)):
            per_file = {f"{group}:{name}": self._load([path]) for name, path in _file_names(files).items()}
            self.splits[group] = [p for problems in per_file.values() for p in problems]
            if len(per_file) > 1:
                self.splits.update(per_file)
                self.groups[group] = list(per_file)
            else:
                self.groups[group] = [group]
            for key, problems in per_file.items():
                if not problems:
                    raise ConfigError(f"{SECTION}.{group}_files: {key.split(':', 1)[1]} holds no row")
        if not self.splits["train"]:
            raise ConfigError(f"{SECTION}.train_files {cfg.train_files} hold no row")
        self.overlap = check_overlap(self.splits, self.groups, cfg.eval_overlap, SECTION)

    # -- loading --
    def _load(self, files: list[str], require_answer: bool = True) -> list[Problem]:
        problems = []
        for path in files:
            for index, row in enumerate(dataset_rows(path)):
                where = f"{SECTION}: {path} row {index}"
                if isinstance(row, Exception):
                    raise ConfigError(f"{where}: {row}; fix or remove the row")
                problems.append(self._problem(row, where))
        return problems

    def _problem(self, row: Any, where: str) -> Problem:
        cfg = self.cfg
        if not isinstance(row, dict):
            raise ConfigError(f"{where} is a {type(row).__name__}, not an object with columns")
        if cfg.prompt_column not in row:
            raise ConfigError(
                f"{where} has no column {cfg.prompt_column!r} (columns: {sorted(row)}); set "
                f"{SECTION}.prompt_column to the prompt's column"
            )
        answer = ""
        if cfg.answer_column:
            if cfg.answer_column not in row or row[cfg.answer_column] is None:
                raise ConfigError(
                    f"{where} has no column {cfg.answer_column!r} (columns: {sorted(row)}); set "
                    f"{SECTION}.answer_column to the answer's column, or '' when the data has no answers"
                )
            try:
                answer = _text(row[cfg.answer_column])
            except ValueError as err:
                raise ConfigError(f"{where}: {err}") from None
        prompt = row[cfg.prompt_column]
        try:
            text, ids = self._prompt_ids(prompt)
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None
        if self.limit is not None and len(ids) > self.limit:
            raise ConfigError(
                f"{where}: the prompt has {len(ids)} tokens, more than the {self.limit} the model can "
                "take (its positions minus rollout.sampling.max_new_tokens, or task.dataset."
                "max_prompt_tokens): shorten or remove the row, or raise the model's positions"
            )
        fields = {k: v for k, v in row.items() if k not in (cfg.prompt_column, cfg.answer_column)}
        fields = json.loads(json.dumps(fields, default=str))  # plain JSON values: what a verifier service receives
        return Problem(prompt_ids=ids, answer=answer, prompt_text=text, fields=fields)

    def _prompt_ids(self, prompt: Any) -> tuple[str, list[int]]:
        """(the prompt's text as the data gave it, its token ids)."""
        cfg = self.cfg
        if isinstance(prompt, list):
            if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in prompt):
                raise ValueError("the prompt is a list but not chat messages ({role, content} objects)")
            if not self.use_template:
                raise ValueError(
                    "the prompt is chat messages but no chat template applies (task.dataset.chat_template "
                    "or a tokenizer without one); give the prompt as text"
                )
            messages = [dict(m) for m in prompt]
            text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
            if cfg.instruction:
                messages[-1]["content"] = f"{messages[-1]['content']} {cfg.instruction}"
        elif isinstance(prompt, str) and prompt.strip():
            text = prompt
            messages = [{"role": "user", "content": f"{prompt} {cfg.instruction}".strip()}]
        else:
            raise ValueError(f"the prompt {str(prompt)[:60]!r} is empty or not text")
        if self.use_template:
            if cfg.system_prompt and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": cfg.system_prompt})
            ids = self.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return text, list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        content = messages[-1]["content"]
        if self.hf_tokenizer is not None:
            return text, list(self.hf_tokenizer.encode(content))
        return text, [self.tokenizer.bos_id] + self.tokenizer.encode(content)

    def target_ids(self, problem: Problem) -> list[int]:
        """The reference completion (the supervised warm start): the answer, then end of sequence."""
        if not problem.answer:
            raise ConfigError(
                f"warm_start trains on the answers but {SECTION}.answer_column is empty: set "
                "warm_start.enabled=false or start from init.hf_checkpoint"
            )
        return self.tokenizer.encode(problem.answer) + [self.tokenizer.eos_id]

    def score(self, problem: Problem, response_ids: list[int]) -> float:
        raise ConfigError("task.name=dataset has no reward of its own: name reward.functions")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bool) or value is None:
        raise ValueError(f"answer {value!r} is not text or a number")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value)
