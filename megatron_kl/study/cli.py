"""``megatron-kl study --config configs/study/<name>.yaml [--report-only] [overrides]``: run the grid
locally (one process per run, resumable), then write figures and report.md. Exit 1 when a run failed
(it is in the report), 2 on a config error."""

from __future__ import annotations

import logging
import sys

from megatron_kl.config import ConfigError


def main(argv: list[str]) -> int:
    from megatron_kl.cli_help import Parser, normalize_overrides

    parser = Parser(prog="megatron-kl study", description=__doc__)
    parser.add_argument("--config", required=True, help="study YAML, e.g. configs/study/cpu.yaml")
    parser.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = parser.parse_args(normalize_overrides(list(argv)))
    return run(args.config, args.overrides, args.report_only)


def run(config: str, overrides: list[str], report_only: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from megatron_kl.study.grid import expand, load_study
    from megatron_kl.study.report import write_report
    from megatron_kl.study.runner import run_study

    try:
        study = load_study(config, overrides)
        runs = expand(study)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"megatron-kl study: config error: {err}", file=sys.stderr)
        return 2
    if report_only:
        import json
        from pathlib import Path

        status_file = Path(study.output_dir) / "status.json"
        status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    else:
        status = run_study(study, runs)
    result = write_report(study, runs, status)
    for claim in result["claims"]:
        print(f"claim {claim['claim']}: {claim['verdict']}")
    print(f"report: {result['report']}")
    if study.caveat:
        print(f"caveat: {study.caveat}")
    failed = [name for name, entry in status.items() if entry.get("state") != "ok"]
    if failed or len(status) < len(runs):
        print(f"megatron-kl study: {len(failed)} run(s) failed: {failed}", file=sys.stderr)
        return 1
    return 0
