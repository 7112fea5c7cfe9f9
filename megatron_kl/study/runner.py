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
        else:
            entry["state"] = "failed"
            entry["error_tail"] = _tail(log_file)
            log.warning("%s failed (exit %s); log tail:\n%s", spec.name, code, entry["error_tail"])
        status[spec.name] = entry
        status_file.write_text(json.dumps(status, indent=2))
    return status
