"""`megatron-kl` command line: one subcommand per job (audit, train, study, convert, launch, config, validate)."""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-kl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("audit", add_help=False, help="exact gradient audit of every KL configuration (tabular policy); "
                   "--dynamics: their exact training dynamics (megatron-kl audit --help)")
    train = sub.add_parser("train", help="RL training (torchrun for several ranks)")
    train.add_argument("--config", required=True, help="YAML config, e.g. configs/cpu/default.yaml")
    train.add_argument("--check", action="store_true", help="validate the configuration, print it resolved with the "
                       "KL verdict and what a start would do (fresh / resume / finished); exit 0, or 2 naming the "
                       "field; nothing is written")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. kl.estimator=k3 train.steps=5")
    study = sub.add_parser("study", help="run a grid of KL configurations x seeds and write the report")
    study.add_argument("--config", required=True, help="study YAML, e.g. configs/study/cpu.yaml")
    study.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    study.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    convert = sub.add_parser("convert", help="HF <-> Megatron checkpoints (megatron-kl convert --help)",
                             add_help=False)
    convert.add_argument("args", nargs=argparse.REMAINDER)
    launch = sub.add_parser("launch", help="NeMo-Run: local torchrun or Slurm (megatron-kl launch --help)",
                            add_help=False)
    launch.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("config", help="megatron-kl config show [--config X] [overrides] [--section S]: every field "
                   "with its type, default, value and description", add_help=False)
    validate = sub.add_parser("validate", help="one-command node check (megatron-kl validate --help)", add_help=False)
    validate.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["convert"]:  # its own parser (options of its own, --help included)
        from megatron_kl.models.convert import main as convert_main

        return convert_main(argv[1:])
    if argv[:1] == ["launch"]:
        from megatron_kl.launch.cli import main as launch_main

        return launch_main(argv[1:])
    if argv[:2] == ["config", "show"]:
        from megatron_kl.config_reference import main as config_main

        return config_main(argv[2:])
    if argv[:1] == ["audit"]:
        from megatron_kl.kl.audit_cli import main as audit_main

        return audit_main(argv[1:])
    if argv[:1] == ["validate"]:
        from megatron_kl.launch.validate import main as validate_main

        return validate_main(argv[1:])
    args = _build_parser().parse_args(argv)
    if args.command == "train":
        from megatron_kl.train.cli import main as train_main

        return train_main(args.config, args.overrides, args.check)
    if args.command == "study":
        from megatron_kl.study.cli import main as study_main

        return study_main(args.config, args.overrides, args.report_only)
    return 2


if __name__ == "__main__":
    sys.exit(main())
