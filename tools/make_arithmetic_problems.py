"""Generated arithmetic word problems for a real pretrained model (the math task's {"problem", "answer"} rows).

    python tools/make_arithmetic_problems.py --out runs/data/arithmetic-problems [--train 2000 --eval 200]

Writes ``train.jsonl`` and ``eval.jsonl`` (in-domain: addition of two 1-2 digit numbers as bare expressions,
phrased in several ways) and ``ood.jsonl`` (out of distribution: the same additions told as short word problems,
GSM8K's form at one step). Answers are integers, scored with math-verify from the model's \\boxed{}.
Deterministic for a given ``--seed``; the three files share no problem.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PHRASES = ("What is {a} + {b}?", "Compute {a} + {b}.", "Calculate {a} + {b}.", "{a} + {b} = ?")
STORIES = (
    "{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
    "There are {a} {things} in a box. {name} puts {b} more {things} in it. How many {things} are in the box?",
    "{name} collected {a} {things} on Monday and {b} {things} on Tuesday. How many {things} did {name} "
    "collect in total?",
)
NAMES = ("Sam", "Mia", "Ravi", "Lena", "Tom", "Ana")
THINGS = ("apples", "marbles", "stickers", "books", "coins", "shells")


def problems(split: str, count: int, seed: int, exclude: set) -> list[dict]:
    """``count`` rows of ``split``; ``exclude`` (the (a, b) pairs other splits use) grows with them."""
    rng = random.Random(f"{seed}/{split}")
    rows, seen = [], exclude
    while len(rows) < count:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        if split == "ood":
            text = rng.choice(STORIES).format(a=a, b=b, name=rng.choice(NAMES), things=rng.choice(THINGS))
        else:
            text = rng.choice(PHRASES).format(a=a, b=b)
        rows.append({"problem": text, "answer": str(a + b)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    used: set = set()
    for split, count in (("eval", args.eval), ("ood", args.eval), ("train", args.train)):
        rows = problems(split, count, args.seed, used)
        with open(out / f"{split}.jsonl", "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{out / f'{split}.jsonl'}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
