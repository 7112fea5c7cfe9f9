"""Writes the worked example's synthetic word problems (data/train.jsonl, eval.jsonl, ood.jsonl), the same on every
machine: ``python examples/word_problems/make_data.py``. Columns: ``story`` (the prompt), ``solution`` (the number),
``unit`` (what is counted) and ``operation``; in-domain amounts are 1-20, the OOD split's first amount is 21-40."""

import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cy", "Dee", "Eli", "Fay", "Gus", "Ida"]
UNITS = ["apples", "pens", "cards", "books", "coins", "shells"]


def story(rng: random.Random, low: int, high: int) -> dict:
    name, unit = rng.choice(NAMES), rng.choice(UNITS)
    a = rng.randint(low, high)
    if rng.random() < 0.5:
        b = rng.randint(1, 20)
        text, solution, operation = f"{name} has {a} {unit} and gets {b} more. How many {unit}?", a + b, "add"
    else:
        b = rng.randint(1, a)
        text, solution, operation = f"{name} has {a} {unit} and gives {b} away. How many {unit}?", a - b, "subtract"
    return {"story": text, "solution": solution, "unit": unit, "operation": operation}


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(7)
    held_out = [story(rng, 1, 20) for _ in range(64)]
    seen = {row["story"] for row in held_out}
    train = []
    while len(train) < 2000:
        row = story(rng, 1, 20)
        if row["story"] not in seen:  # no evaluation prompt is trained on
            train.append(row)
    ood = [story(rng, 21, 40) for _ in range(64)]
    for name, rows in (("train", train), ("eval", held_out), ("ood", ood)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
