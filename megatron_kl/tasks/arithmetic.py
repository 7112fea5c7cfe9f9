"""A synthetic arithmetic task a tiny model learns on CPU in minutes.

Prompt ``<bos>37+45=``, answer ``82<eos>`` (reward 1 for the exact answer followed by EOS, 0 otherwise).
In-domain: operands with ``min_digits..max_digits`` digits and ``operators``; OOD: operands with
``ood_min_digits..ood_max_digits`` digits and ``ood_operators`` (longer operands, possibly unseen
operators), or, with ``held_out_min_operand`` > 0, a region of the in-domain operand space that training never
shows: both operands in ``[held_out_min_operand, held_out_max_operand]`` (systematic generalisation, which a small
model partly achieves). The tokenizer is character level, so the model's vocabulary only needs ``CHARS``.
"""

from __future__ import annotations

import random
from typing import Optional

from megatron_kl.config import ConfigError
from megatron_kl.tasks.base import SPLITS, ArithmeticConfig, Problem

SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+-*="
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class CharTokenizer:
    """One token per character of ``chars``, after ``<pad> <bos> <eos>``; ``vocabulary`` names it in errors."""

    def __init__(self, chars: str = CHARS, vocabulary: str = f"the arithmetic vocabulary {CHARS!r}"):
        self.vocabulary = vocabulary
        self.itos = list(SPECIALS) + list(chars)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.vocab_size = len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in {self.vocabulary}") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] if i >= len(SPECIALS) else "" for i in ids if 0 <= i < len(self.itos))


def _validate(cfg: ArithmeticConfig) -> None:
    for prefix in ("", "ood_"):
        lo, hi = getattr(cfg, prefix + "min_digits"), getattr(cfg, prefix + "max_digits")
        if not 1 <= lo <= hi:
            raise ConfigError(
                f"task.arithmetic.{prefix}min_digits={lo} / {prefix}max_digits={hi}: need 1 <= min <= max"
            )
        ops = getattr(cfg, prefix + "operators")
        if not ops or any(o not in _OPS for o in ops):
            raise ConfigError(f"task.arithmetic.{prefix}operators={ops!r}: use a non-empty subset of {''.join(_OPS)!r}")
    lo, hi = cfg.held_out_min_operand, _held_out_max(cfg)
    if cfg.held_out_min_operand or cfg.held_out_max_operand:
        if not 1 <= lo <= hi <= 10**cfg.max_digits - 1:
            raise ConfigError(
                f"task.arithmetic.held_out_min_operand={lo} / held_out_max_operand="
                f"{cfg.held_out_max_operand}: need 1 <= min <= max <= {10**cfg.max_digits - 1} "
                f"(max_digits={cfg.max_digits}; max 0 = the largest), or both 0 (no held-out region)"
            )


def _held_out_max(cfg: ArithmeticConfig) -> int:
    return cfg.held_out_max_operand or 10**cfg.max_digits - 1


class ArithmeticTask:
    default_reward = "arithmetic"  # the same rule as score(), as a reward function (megatron_kl.rewards.builtin)

    def __init__(self, cfg: ArithmeticConfig, seed: int = 0, eval_size: int = 64):
        _validate(cfg)
        self.cfg = cfg
        self.seed = seed
        self.eval_size = eval_size
        self.tokenizer = CharTokenizer()

    def num_problems(self, split: str) -> Optional[int]:
        return None if split == "train" else self.eval_size

    def longest_prompt_tokens(self) -> int:
        """bos, two operands of the most digits any split draws, the operator and "=" (one character each)."""
        digits = max(
            self.cfg.max_digits,
            self.cfg.ood_max_digits,
            len(str(_held_out_max(self.cfg))) if self.cfg.held_out_min_operand else 0,
        )
        return 1 + 2 * digits + 2

    def _operand(self, rng: random.Random, lo: int, hi: int) -> int:
        digits = rng.randint(lo, hi)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def problem(self, split: str, index: int) -> Problem:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; use one of {SPLITS}")
        rng = random.Random(f"{self.seed}/{split}/{index}")
        held_out = self.cfg.held_out_min_operand
        lo_h, hi_h = held_out, _held_out_max(self.cfg)
        if held_out and split == "ood":  # the held-out region: both operands in [lo_h, hi_h]
            op = rng.choice(self.cfg.operators)
            a, b = rng.randint(lo_h, hi_h), rng.randint(lo_h, hi_h)
        else:
            prefix = "ood_" if split == "ood" else ""
            lo, hi = getattr(self.cfg, prefix + "min_digits"), getattr(self.cfg, prefix + "max_digits")
            op = rng.choice(getattr(self.cfg, prefix + "operators"))
            a, b = self._operand(rng, lo, hi), self._operand(rng, lo, hi)
            while held_out and lo_h <= a <= hi_h and lo_h <= b <= hi_h:  # never inside the held-out region
                a, b = self._operand(rng, lo, hi), self._operand(rng, lo, hi)
        answer = str(_OPS[op](a, b))
        if self.cfg.reverse_answer:
            answer = answer[::-1]
        text = f"{a}{op}{b}="
        return Problem(
            prompt_ids=[self.tokenizer.bos_id] + self.tokenizer.encode(text), answer=answer, prompt_text=text
        )

    def target_ids(self, problem: Problem) -> list[int]:
        """The reference completion (supervised warm start)."""
        return self.tokenizer.encode(problem.answer) + [self.tokenizer.eos_id]

    def score(self, problem: Problem, response_ids: list[int]) -> float:
        return float(list(response_ids) == self.target_ids(problem))
