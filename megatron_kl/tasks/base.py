"""The task protocol and the task config shared by the built-in tasks.

A task owns a tokenizer and yields :class:`Problem` s (prompt token ids + a reference answer) for the
splits ``train`` (in-domain), ``eval`` (in-domain, held out) and ``ood``. Problems are a pure function of
(seed, split, index), so the data cursor of a run is just the index of the next training problem.
``score`` maps a decoded response to a reward in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from megatron_kl.constraints import check_declared, checked
from megatron_kl.registry import Registry

SPLITS = ("train", "eval", "ood")


@dataclass(frozen=True)
class TaskSpec:
    """A task by name (``task.name``): ``build(config, context, options) -> Task`` with the task section, the
    :class:`megatron_kl.tasks.dataset.TaskContext` (init checkpoint, prompt token limit) and ``task.options`` read
    into ``options`` (a dataclass; None when the task declares none). Built-ins: ``tasks/registry.py``."""

    name: str
    build: Callable[..., Any]
    description: str = ""
    options: Optional[type] = None


TASKS: Registry[TaskSpec] = Registry("task", TaskSpec, builtins="megatron_kl.tasks.registry")


@dataclass(frozen=True)
class Problem:
    """One prompt: its token ids, the reference answer ("" when the data has none), the prompt as the data gave it
    (before any chat template), and the data row's other fields (passed to reward functions)."""

    prompt_ids: list[int]
    answer: str
    prompt_text: str = ""
    fields: dict = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@runtime_checkable
class Task(Protocol):
    tokenizer: Tokenizer

    def problem(self, split: str, index: int) -> Problem: ...

    def num_problems(self, split: str) -> Optional[int]:
        """Size of a finite split, None for generated (unbounded) splits."""

    def score(self, problem: Problem, response_ids: list[int]) -> float: ...

    def longest_prompt_tokens(self) -> int:
        """The most prompt tokens a problem of any split has (checked against the model's positions with the
        longest response asked for, before anything starts)."""

    # the built-in reward used when reward.functions is empty (megatron_kl.rewards), None when the task has none
    default_reward: Optional[str]


@dataclass(frozen=True)
class ArithmeticConfig:
    """Integer arithmetic ``a op b =`` with a verifiable answer; the OOD split changes the operands' size
    and may add operators never seen in training."""

    min_digits: int = checked(1, ge=1)
    max_digits: int = checked(2, ge=1)
    operators: str = checked("+-", free=True, nonempty=True)
    ood_min_digits: int = checked(3, ge=1)
    ood_max_digits: int = checked(3, ge=1)
    ood_operators: str = checked("+-", free=True, nonempty=True)
    reverse_answer: bool = False  # write the answer least-significant digit first (easier for tiny models)
    # held_out_min_operand > 0: a held-out region of the in-domain operand space. Training and in-domain evaluation
    # never pose a problem whose operands both lie in [held_out_min_operand, held_out_max_operand]; the OOD split
    # poses only those (the in-domain operators; ood_min_digits/ood_max_digits/ood_operators then unused).
    # held_out_max_operand 0: the largest max_digits-digit number.
    held_out_min_operand: int = checked(0, ge=0)
    held_out_max_operand: int = checked(0, ge=0)


@dataclass(frozen=True)
class MathConfig:
    """Math word problems with \\boxed{} answers checked by math-verify."""

    train_files: list[str] = field(default_factory=list)  # jsonl / parquet in a supported shape
    eval_files: list[str] = field(default_factory=list)
    ood_files: list[str] = field(default_factory=list)
    tokenizer: str = checked("", free=True)  # HF tokenizer path or name (chat template taken from it)
    system_prompt: Optional[str] = checked(None, free=True)
    instruction: str = checked("Let's think step by step and output the final answer within \\boxed{}.", free=True)
    max_prompt_tokens: int = checked(1024, ge=1)
    # evaluation questions that also appear in train_files (compared after lower-casing and dropping whitespace):
    # refuse names each file and its count; drop leaves them out of the scores (counted in the log); report keeps
    # them and warns with the counts
    eval_overlap: str = checked("refuse", resumable=True, choices=("refuse", "drop", "report"))


CHAT_TEMPLATE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class DatasetConfig:
    """Your own prompts: jsonl (optionally .gz), parquet, a Hugging Face ``datasets`` directory (``save_to_disk``;
    ``DIR:split`` for one split of a DatasetDict) or a directory of parquet / jsonl files, with the columns named
    here. Every other column of a row reaches the reward functions as ``sample.fields``. A row without the prompt (or
    the answer, when ``answer_column`` is set) or with a prompt longer than the model's positions allow is refused
    naming the file and the row."""

    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)  # in-domain evaluation (eval/id/*)
    ood_files: list[str] = field(default_factory=list)  # out-of-distribution evaluation (eval/ood/*)
    # the column holding the prompt: a string, or a list of chat messages ({role, content})
    prompt_column: str = checked("prompt", free=True, nonempty=True)
    # the column holding the reference answer ("" = the data has none; reward functions get answer "")
    answer_column: str = checked("answer", free=True)
    # an HF tokenizer (path or name); "" = init.hf_checkpoint's; "chars" = one token per printable ASCII character
    # (tiny models on a CPU)
    tokenizer: str = checked("", free=True)
    # apply the tokenizer's chat template to the prompt: auto = when it has one; on = required; off = plain text
    chat_template: str = checked("auto", choices=CHAT_TEMPLATE_MODES)
    system_prompt: Optional[str] = checked(None, free=True)  # a system message (with the chat template)
    instruction: str = checked("", free=True)  # appended to each prompt (after one space)
    # the longest prompt accepted, in tokens; 0 = what the model's positions leave after rollout.sampling.max_new_tokens
    max_prompt_tokens: int = checked(0, ge=0)
    # evaluation prompts that also appear in train_files (lower-cased, whitespace dropped): refuse | drop | report
    eval_overlap: str = checked("refuse", resumable=True, choices=("refuse", "drop", "report"))


@dataclass(frozen=True)
class TaskConfig:
    # arithmetic | math | dataset (your own data) | a registered task (TASKS) | package.module:SPEC
    name: str = checked("arithmetic", choices=TASKS)
    seed: int = checked(0, ge=0)
    eval_size: int = checked(64, ge=1)  # problems in each generated evaluation split
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    math: MathConfig = field(default_factory=MathConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    # the settings of a task from outside the package, read into its spec's ``options`` dataclass
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_declared(self, "task.")
