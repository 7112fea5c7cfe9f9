"""``megatron-kl launch {local,slurm} --config X.yaml [--cluster NAME] [--dryrun] [--detach] [overrides]``,
``megatron-kl launch status|logs <experiment id> [--home DIR] [--task NAME]``.

The config is a training YAML (one task) or a study YAML (one task per configuration x seed; after a local
run the study report is written). ``--cluster NAME`` applies a cluster of ``launch/clusters.py`` (``--clusters``
names another file): its executor must match the subcommand, its ``launch:`` settings come before the
command-line overrides. Exit 0 when every task succeeded, 1 when one failed (its log tail is printed), 2 on a
config error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from pathlib import Path

from megatron_kl.cli_help import Parser, help_when_bare, normalize_overrides
from megatron_kl.config import ConfigError
from megatron_kl.launch import experiment
from megatron_kl.launch.experiment import plan, task_log
from megatron_kl.study.report import write_report


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="megatron-kl launch", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    for kind in ("local", "slurm"):
        p = sub.add_parser(kind, help=f"run with NeMo-Run's {kind} executor")
        p.add_argument("--config", required=True, help="training YAML or study YAML")
        p.add_argument("--dryrun", action="store_true", help="print what would be submitted, run nothing")
        p.add_argument("--cluster", default=None, help="a cluster function of --clusters (launch/clusters.py)")
        p.add_argument("--clusters", default="launch/clusters.py", help="the file defining the clusters")
        if kind == "slurm":
            p.add_argument("--detach", action="store_true", help="return after submitting")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. launch.slurm.nodes=4")
    for action in ("status", "logs"):
        p = sub.add_parser(action, help=f"{action} of a launched experiment")
        p.add_argument("experiment_id", help="the id `launch local|slurm` printed (experiment: ...)")
        p.add_argument("--home", default="runs/nemo_run", help="launch.home the experiment was launched with")
        if action == "logs":
            p.add_argument("--task", default=None, help="one task (default: all)")
    return parser


def _study_report(launch_plan, states: dict) -> int:
    """status.json + report.md for a study run through NeMo-Run; returns the number of failed runs."""
    status = {}
    for run_spec in launch_plan.runs:
        info = states.get(run_spec.name, {})
        ok = info.get("state") == "SUCCEEDED" and (run_spec.output_dir / "summary.json").is_file()
        status[run_spec.name] = {
            "configuration": run_spec.configuration,
            "seed": run_spec.seed,
            "output_dir": str(run_spec.output_dir),
            "state": "ok" if ok else "failed",
            "nemo_run_state": info.get("state", "MISSING"),
            "log": info.get("job_dir", ""),
        }
        if not ok:
            status[run_spec.name]["error_tail"] = task_log(info.get("job_dir", ""), lines=15)
    out = Path(launch_plan.study.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "status.json").write_text(json.dumps(status, indent=2))
    result = write_report(launch_plan.study, launch_plan.runs, status)
    print(f"report: {result['report']}")
    return sum(entry["state"] != "ok" for entry in status.values())


def submit(executor_kind: str, launch_plan, dryrun: bool = False, detach: bool = False, customize=None) -> int:
    """Dry-run (print the scripts) or run a plan with NeMo-Run; the exit code of ``megatron-kl launch`` (0: all
    tasks succeeded, 1: one failed). Shared with the recipes in ``launch/`` and ``megatron-kl validate``."""
    if dryrun:
        for name, script in experiment.dryrun(executor_kind, launch_plan, customize).items():
            print(f"# ---- task {name}\n{script}")
        return 0
    exp_id, states = experiment.launch(executor_kind, launch_plan, detach=detach, customize=customize)
    print(f"experiment: {exp_id}  (megatron-kl launch status {exp_id} --home {launch_plan.home})")
    if not states:
        return 0
    failed = {name: info for name, info in states.items() if info["state"] != experiment.TERMINAL_OK}
    for name, info in states.items():
        print(f"  {name}: {info['state']}")
    for name, info in failed.items():
        print(
            f"megatron-kl launch: task {name} ended {info['state']}; log tail:\n{experiment.task_log(info['job_dir'])}",
            file=sys.stderr,
        )
    if launch_plan.study is not None:  # every task ended (local, or Slurm without --detach): the study's report
        failed_runs = _study_report(launch_plan, states)
        return 1 if failed or failed_runs else 0
    return 1 if failed else 0


def load_clusters(path: str) -> dict:
    """``CLUSTERS`` (name -> function returning a Cluster) of a clusters file such as launch/clusters.py."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--clusters {path} does not exist (run from the repository root, or name the file)")
    spec = importlib.util.spec_from_file_location("megatron_kl_user_clusters", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    clusters = getattr(module, "CLUSTERS", None)
    if not isinstance(clusters, dict):
        raise ConfigError(f"{path} defines no CLUSTERS mapping (name -> function returning a Cluster)")
    return clusters


def _run(args) -> int:
    overrides, customize = list(args.overrides), None
    if args.cluster is not None:
        clusters = load_clusters(args.clusters)
        if args.cluster not in clusters:
            raise ConfigError(f"--cluster {args.cluster!r} is not in {args.clusters}: {sorted(clusters)}")
        cluster = clusters[args.cluster]()
        if cluster.executor != args.action:
            raise ConfigError(
                f"--cluster {args.cluster} runs with the {cluster.executor} executor: use "
                f"`megatron-kl launch {cluster.executor}`"
            )
        overrides, customize = cluster.overrides() + overrides, cluster.customize
    return submit(args.action, plan(args.config, overrides), args.dryrun, getattr(args, "detach", False), customize)


def _inspect(args) -> int:
    exp = experiment.reconstruct(args.experiment_id, args.home)
    states = experiment.task_states(exp)
    if args.action == "status":
        for name, info in states.items():
            print(f"{name}: {info['state']}  job {info['job_id']}  dir {info['job_dir']}")
        return 0 if all(i["state"] == experiment.TERMINAL_OK for i in states.values()) else 1
    names = [args.task] if args.task else list(states)
    for name in names:
        if name not in states:
            raise ConfigError(f"--task {name!r} is not in experiment {args.experiment_id}: {sorted(states)}")
        print(f"# ---- task {name} ({states[name]['state']})\n{experiment.task_log(states[name]['job_dir'], 200)}")
    return 0


def main(argv: list[str]) -> int:
    parser = _parser()
    if help_when_bare(parser, argv):
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    args = parser.parse_args(normalize_overrides(list(argv)))
    try:
        return _inspect(args) if args.action in ("status", "logs") else _run(args)
    except ConfigError as err:
        print(f"megatron-kl launch: config error: {err}", file=sys.stderr)
        return 2
