"""World sizes of the distributed tests: their defaults on a CPU machine, or the list in
``MEGATRON_KL_TEST_WORLDS`` (``megatron-kl validate`` sets ``8`` on an 8-GPU node: TP=8 over NCCL)."""

from __future__ import annotations

import os

ENV = "MEGATRON_KL_TEST_WORLDS"


def worlds(default: list[int]) -> list[int]:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return list(default)
    try:
        return [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} must be comma-separated integers, e.g. 2,8") from None
