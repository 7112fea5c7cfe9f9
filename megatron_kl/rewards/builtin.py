"""The built-in reward functions, each in the interface of a user's (``types.RewardInput`` in, a float out).

arithmetic   1 when the response's tokens are exactly the answer's followed by the end-of-sequence token
             (the arithmetic task's reward)
math_verify  1 when math-verify finds the response's final answer equal to the reference (the math task's)
exact_match  1 when the response equals the answer after trimming and collapsing whitespace
             (kwargs: ignore_case=false)
boxed_match  1 when the last \\boxed{...} of the response equals the answer (whitespace as exact_match)
regex_match  1 when the last match of ``pattern`` (its first group if it has one) equals the answer
             (kwargs: pattern, required; ignore_case=false)
"""

from __future__ import annotations

import re
from typing import Optional

from megatron_kl.rewards.types import RewardInput
from megatron_kl.tasks.math import score_answer


def _normal(text: str, ignore_case: bool) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text.lower() if ignore_case else text


def make_arithmetic(tokenizer):
    def arithmetic(sample: RewardInput) -> float:
        return float(list(sample.response_ids) == tokenizer.encode(sample.answer) + [tokenizer.eos_id])

    return arithmetic


def math_verify(sample: RewardInput) -> float:
    return score_answer(sample.answer, sample.response)


def exact_match(sample: RewardInput, ignore_case: bool = False) -> float:
    return float(_normal(sample.response, ignore_case) == _normal(sample.answer, ignore_case))


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (braces balanced inside), None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def boxed_match(sample: RewardInput, ignore_case: bool = False) -> float:
    found = last_boxed(sample.response)
    return float(found is not None and _normal(found, ignore_case) == _normal(sample.answer, ignore_case))


def make_regex_match(pattern: str, ignore_case: bool = False):
    """``pattern`` compiled once (an invalid one is a ValueError at start, not at the first step)."""
    try:
        compiled = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as err:
        raise ValueError(f"pattern {pattern!r} is not a regular expression ({err})") from None

    def regex_match(sample: RewardInput) -> float:
        matches = list(compiled.finditer(sample.response))
        if not matches:
            return 0.0
        last = matches[-1]
        found = last.group(1) if compiled.groups else last.group(0)
        return float(found is not None and _normal(found, ignore_case) == _normal(sample.answer, ignore_case))

    return regex_match
