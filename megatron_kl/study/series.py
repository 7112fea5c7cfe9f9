"""A run's metric series from its metrics.jsonl records (the study's report and figures read them here)."""

from __future__ import annotations

import re
from typing import Optional


def series(records: list[dict], key: str) -> dict[int, float]:
    """step -> value; a key with ``mean@k`` matches the run's ``mean@<eval.k>``."""
    if "mean@k" in key:
        pattern = re.compile(re.escape(key).replace("mean@k", r"mean@\d+"))
        return {r["step"]: v for r in records for name, v in r.items() if pattern.fullmatch(name) and v is not None}
    return {r["step"]: r[key] for r in records if r.get(key) is not None}


def final(records: list[dict], key: str) -> Optional[float]:
    """The last logged value of ``key`` (None when the run never logged it)."""
    values = series(records, key)
    return values[max(values)] if values else None
