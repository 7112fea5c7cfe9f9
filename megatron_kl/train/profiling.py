"""``logging.profile_steps``: chosen RL steps run under ``torch.profiler``, with the step's phases labelled.

For every listed step (0-based, as in ``metrics.jsonl``) each rank writes under ``<output_dir>/profile/``:

  step_<N>.rank<R>.json          the Chrome trace (chrome://tracing, Perfetto)
  step_<N>.rank<R>.txt           the ops, largest self time first
  step_<N>.rank<R>.summary.json  per phase: its wall seconds, the self seconds of its GEMM ops and of all its
                                 ops, and how many ops it ran

The phases are the ones ``time/*`` measures, as ``record_function`` ranges (:func:`phase`): ``rollout_wait``,
``reference``, ``teacher`` (distillation), ``old_logprobs``, ``unreplayed_logprobs`` (routing replay's metric pass), ``update``,
``weight_sync``; ops outside them are counted under ``other``.
GEMM ops are the matrix products a linear layer lowers to (:data:`GEMM_OPS`); on a CUDA rank their device time
is summed too. ``tools/bench_step.py`` reads the summary to split the step into GEMM work and everything else.
Ops are placed by time, not by thread: with asynchronous rollouts (``train.staleness > 0``) the background
generation that overlaps a phase is counted in it. The five ranges cost a few microseconds each per step when no
profiler runs (~6 us measured on 2 CPU cores); a profiled step is slower than the others (the profiler records
every op), so benchmarks leave it out of their medians.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function

log = logging.getLogger(__name__)

PHASES = ("rollout_wait", "reference", "teacher", "old_logprobs", "unreplayed_logprobs", "update", "weight_sync")
PREFIX = "megatron_kl/"
GEMM_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_int_mm", "aten::addbmm"}
)


def phase(name: str, timings: Optional[dict] = None):
    """A labelled range of the step; its wall seconds go to ``timings["time/<name>"]`` (also when the block
    raises), so the logged ``time/*`` and the profiled range cover the same work."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; one of {PHASES}")
    return _timed_range(PREFIX + name, f"time/{name}", timings)


@contextmanager
def _timed_range(label: str, key: str, timings: Optional[dict]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        with record_function(label):
            yield
    finally:
        if timings is not None:
            timings[key] = time.perf_counter() - start


def summarize(events, step_seconds: float) -> dict:
    """Per phase: wall seconds, GEMM / all ops' self CPU (and device) seconds, op count, from the profiler's
    ``events()``. An op belongs to the phase whose range contains its start; ranges may come from any thread."""
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name[len(PREFIX) :])
        for e in events
        if e.name.startswith(PREFIX) and e.name[len(PREFIX) :] in PHASES
    )
    starts = [r[0] for r in ranges]
    names = (*PHASES, "other")
    out = {name: {"wall_s": 0.0, "gemm_s": 0.0, "ops_s": 0.0, "ops": 0, "gemm_device_s": 0.0} for name in names}
    for start, end, name in ranges:
        out[name]["wall_s"] += (end - start) / 1e6
    for event in events:
        if event.name.startswith(PREFIX) or not event.name.startswith("aten::"):
            continue
        i = bisect.bisect_right(starts, event.time_range.start) - 1
        name = ranges[i][2] if i >= 0 and event.time_range.start < ranges[i][1] else "other"
        row = out[name]
        self_s = event.self_cpu_time_total / 1e6
        row["ops_s"] += self_s
        row["ops"] += 1
        if event.name in GEMM_OPS:
            row["gemm_s"] += self_s
            row["gemm_device_s"] += event.self_device_time_total / 1e6
    out["other"]["wall_s"] = max(step_seconds - sum(out[n]["wall_s"] for n in PHASES), 0.0)
    return {
        "step_s": step_seconds,
        "phases": out,
        "gemm_s": sum(r["gemm_s"] for r in out.values()),
        "gemm_device_s": sum(r["gemm_device_s"] for r in out.values()),
    }


class StepProfiler:
    """Runs the steps in ``steps`` under ``torch.profiler`` and writes their files (module docstring)."""

    def __init__(self, steps: Sequence[int], out_dir: Path, rank: int):
        self.steps, self.out_dir, self.rank = frozenset(steps), Path(out_dir), rank

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            yield
            seconds = time.perf_counter() - start
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"step_{step}.rank{self.rank}"
        prof.export_chrome_trace(str(stem) + ".json")
        sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        Path(str(stem) + ".txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=60))
        summary = summarize(prof.events(), seconds)
        Path(str(stem) + ".summary.json").write_text(json.dumps(summary, indent=1))
        log.info(
            "profiled step %d: %s.{json,txt,summary.json} (GEMM ops %.3fs of %.3fs)",
            step,
            stem,
            summary["gemm_s"],
            seconds,
        )
