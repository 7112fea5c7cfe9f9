"""Run a study's grid locally, one training process per run (a crash stays in its run), resumable:
runs that already wrote ``summary.json`` are kept. The status of every run goes to ``status.json``
after each run, so an interrupted study loses nothing already done."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from megatron_kl.study.grid import RunSpec, StudyConfig

log = logging.getLogger("megatron_kl.study")


def _tail(path: Path, lines: int = 15) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def outcome_line(run_dir: Path, seconds: float) -> str:
    """One finished run in a line: its time, last reward and exact KL, and the final evaluation."""
    from megatron_kl.train.metrics import read_metrics

    parts = [f"ok in {seconds:.1f} s"]
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in records if r.get("reward/mean") is not None]
    if steps:
        parts.append(f"final reward {steps[-1]['reward/mean']:.3f}")
        if steps[-1].get("kl/exact_token") is not None:
            parts.append(f"exact KL {steps[-1]['kl/exact_token']:.2e}")
    evals = [r for r in records if r.get("eval/id/pass@1") is not None]
    if evals:
        parts.append(f"ID pass@1 {evals[-1]['eval/id/pass@1']:.3f}")
        if evals[-1].get("eval/ood/pass@1") is not None:
            parts.append(f"OOD pass@1 {evals[-1]['eval/ood/pass@1']:.3f}")
    return ", ".join(parts)


def run_study(study: StudyConfig, runs: list[RunSpec], timeout_s: float = 6 * 3600) -> dict:
    out = Path(study.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    status_file = out / "status.json"
    status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    for index, spec in enumerate(runs):
        if (spec.output_dir / "summary.json").is_file() and status.get(spec.name, {}).get("state") == "ok":
            log.info("[%d/%d] %s: done already", index + 1, len(runs), spec.name)
            continue
        log_file = out / "logs" / f"{spec.name}.log"
        cmd = [sys.executable, "-m", "megatron_kl.cli", "train", "--config", study.base, *spec.overrides,
               "logging.progress=false"]
        log.info("[%d/%d] %s", index + 1, len(runs), spec.name)
        start = time.perf_counter()
        with open(log_file, "w") as handle:
            try:
                code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                code = -1
        entry = {"configuration": spec.configuration, "seed": spec.seed, "output_dir": str(spec.output_dir),
                 "returncode": code, "seconds": round(time.perf_counter() - start, 1), "log": str(log_file)}
        if code == 0 and (spec.output_dir / "summary.json").is_file():
            entry["state"] = "ok"
            log.info("[%d/%d] %s: %s", index + 1, len(runs), spec.name, outcome_line(spec.output_dir, entry["seconds"]))
        else:
            entry["state"] = "failed"
            entry["error_tail"] = _tail(log_file)
            log.warning("%s failed (exit %s); log tail:\n%s", spec.name, code, entry["error_tail"])
        status[spec.name] = entry
        status_file.write_text(json.dumps(status, indent=2))
    return status
