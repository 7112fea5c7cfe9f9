"""The worked example's reward functions (docs/your-own-job.md): named in the config as
``examples/word_problems/rewards.py:number`` and ``...:unit``.

``number``: 1 when the first number in the response is the solution; it also reports whether the response held a
number at all (``reward/extra/parsed``). ``unit``: 1 when the response names the counted thing, read from the row's
own ``unit`` column (``sample.fields``).
"""

import re

from megatron_kl.rewards import RewardInput, RewardResult


def number(sample: RewardInput) -> RewardResult:
    found = re.search(r"-?\d+", sample.response)
    correct = found is not None and found.group(0) == sample.answer
    return RewardResult(reward=float(correct), metrics={"parsed": float(found is not None)})


def unit(sample: RewardInput) -> float:
    return float(sample.fields["unit"] in sample.response.split())
