"""The command line of the launch recipes (``launch/train.py``, ``launch/study.py``): pick a cluster from the
lab's ``launch/clusters.py``, then plan and submit exactly as ``megatron-kl launch`` does (same code)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from megatron_kl.config import ConfigError, read_yaml_file
from megatron_kl.launch.cli import submit
from megatron_kl.launch.cluster import Cluster
from megatron_kl.launch.experiment import plan

KINDS = {"train": "a training YAML (configs/cpu, configs/paper)", "study": "a study YAML (configs/study: has base:)"}


def _check_kind(config: str, kind: str) -> None:
    data = read_yaml_file(config)
    is_study = isinstance(data, dict) and "base" in data
    if is_study != (kind == "study"):
        other = "study" if is_study else "train"
        raise ConfigError(
            f"--config {config} is {KINDS[other]}; launch/{kind}.py takes {KINDS[kind]} "
            f"(use launch/{other}.py for this one)"
        )


def main(argv: list[str], clusters: dict[str, Callable[[], Cluster]], kind: str, doc: str = "") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    parser = argparse.ArgumentParser(
        prog=f"launch/{kind}.py", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cluster", required=True, choices=sorted(clusters), help="a function of launch/clusters.py")
    parser.add_argument("--config", required=True, help=KINDS[kind])
    parser.add_argument("--dryrun", action="store_true", help="print the scripts NeMo-Run would submit")
    parser.add_argument("--detach", action="store_true", help="Slurm: return after submitting")
    parser.add_argument("overrides", nargs="*", help="dotted overrides; they win over the cluster's settings")
    args = parser.parse_args(argv)
    try:
        _check_kind(args.config, kind)
        cluster = clusters[args.cluster]()
        launch_plan = plan(args.config, cluster.overrides() + list(args.overrides))
        return submit(cluster.executor, launch_plan, args.dryrun, args.detach, cluster.customize)
    except ConfigError as err:
        print(f"launch/{kind}.py: config error: {err}", file=sys.stderr)
        return 2
