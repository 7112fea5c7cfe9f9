"""``megatron-kl study --config configs/study/<name>.yaml [--report-only] [overrides]``: run the grid
locally (one process per run, resumable), then write figures and report.md. Exit 1 when a run failed or has
not run (the report says which), 2 on a config error or a study already running in output_dir, 75 (130 for
SIGINT) when a stop signal ended it: the same command continues."""

from __future__ import annotations

import logging
import sys

from megatron_kl.cli_help import Parser, normalize_overrides
from megatron_kl.config import ConfigError
from megatron_kl.study.grid import expand, load_study
from megatron_kl.study.report import write_report
from megatron_kl.study.runner import OK, StudyStopped, read_status, run_study


def main(argv: list[str]) -> int:
    parser = Parser(prog="megatron-kl study", description=__doc__)
    parser.add_argument("--config", required=True, help="study YAML, e.g. configs/study/cpu.yaml")
    parser.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = parser.parse_args(normalize_overrides(list(argv)))
    return run(args.config, args.overrides, args.report_only)


def run(config: str, overrides: list[str], report_only: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    try:
        study = load_study(config, overrides)
        runs = expand(study)
        status = read_status(study.output_dir) if report_only else run_study(study, runs)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"megatron-kl study: config error: {err}", file=sys.stderr)
        return 2
    except StudyStopped as stopped:
        print(f"megatron-kl study: {stopped}", file=sys.stderr)
        return stopped.exit_code
    result = write_report(study, runs, status)
    for claim in result["claims"]:
        print(f"claim {claim['claim']}: {claim['verdict']}")
    print(f"report: {result['report']}")
    if study.caveat:
        print(f"caveat: {study.caveat}")
    states = {spec.name: status.get(spec.name, {}).get("state", "not run") for spec in runs}
    failed = [name for name, state in states.items() if state == "failed"]
    not_run = [name for name, state in states.items() if state not in (OK, "failed")]
    if failed or not_run:
        print(
            f"megatron-kl study: {len(failed)} run(s) failed: {failed}; {len(not_run)} not run (or interrupted): "
            f"{not_run}",
            file=sys.stderr,
        )
        return 1
    return 0
