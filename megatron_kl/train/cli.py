"""``megatron-kl train --config X.yaml [section.key=value ...]``: single process, or one rank per process
under torchrun (``torchrun --nproc-per-node 2 -m megatron_kl.cli train ...``)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import warnings

import yaml

from megatron_kl import child_processes, env_vars
from megatron_kl.cli_help import Parser, normalize_overrides
from megatron_kl.config import ConfigError, redact_secrets, to_dict
from megatron_kl.train.checks import distill_verdict, kl_verdict
from megatron_kl.train.config import load_train_config


def single_process_env() -> None:
    """Without torchrun, become rank 0 of a world of 1."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def check(cfg) -> int:
    """``megatron-kl train --check``: validate, print the resolved configuration, the KL verdict and what a start
    would do; exit 0, or 2 naming the field(s). Nothing is written."""
    from megatron_kl.run.run_dir import RunRefused
    from megatron_kl.train.loop import prepare

    try:
        prepared = prepare(cfg)
    except ConfigError as err:
        kind = "refused" if isinstance(err, RunRefused) else "config error"
        print(f"megatron-kl train --check: {kind}: {err}", file=sys.stderr)
        return 2
    cfg = prepared.config
    print(yaml.safe_dump(redact_secrets(to_dict(cfg)), sort_keys=False), end="")
    verdict = kl_verdict(cfg)
    print(f"# run name: {cfg.run_name}")
    print("# KL term: " + (verdict.describe() if verdict is not None else "none (kl.coef=0 or algo.loss=rpg)"))
    if cfg.distill.enabled:
        from megatron_kl.distill.teacher import describe_teacher

        teacher = distill_verdict(cfg)
        print(f"# teacher: {describe_teacher(cfg)}")
        print(
            "# distillation term (to the teacher): "
            + (
                teacher.describe().replace("kl.target", "distill.kl.target")
                if teacher is not None
                else "none (distill.kl.coef=0)"
            )
        )
    plan, out = prepared.plan, cfg.train.output_dir
    print(
        "# start: "
        + {
            "fresh": f"a new run in {out} (an earlier run's files there would move to superseded-<time>/)",
            "resume": f"resume the run in {out} from step {plan.checkpoint_step}",
            "finished": f"nothing to do: the run in {out} finished at step {plan.checkpoint_step}",
        }[plan.kind]
    )
    for note in prepared.notes:
        print(f"# note: {note}")
    print("# configuration OK")
    return 0


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="megatron-kl train", description=__doc__)
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/cpu/default.yaml")
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration, print it resolved with the KL "
        "verdict and what a start would do (fresh / resume / finished); exit 0, or 2 naming the field; "
        "nothing is written",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. kl.estimator=k3 train.steps=5")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(normalize_overrides(list(argv)))
    return run(args.config, args.overrides, args.check)


def run(config_path: str, overrides: list[str], check_only: bool = False) -> int:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("megatron").setLevel(logging.WARNING)

    try:
        cfg = load_train_config(config_path, overrides)
    except (ConfigError, ValueError) as err:
        print(f"megatron-kl train: config error: {err}", file=sys.stderr)
        return 2
    if check_only:
        return check(cfg)

    try:
        launcher = env_vars.process_id("MEGATRON_KL_PARENT_PID")
    except env_vars.EnvVarError as err:
        print(f"megatron-kl train: config error: {err}", file=sys.stderr)
        return 2
    if launcher is not None:  # started by `megatron-kl launch local`: stop (and save) when it ends
        child_processes.stop_when_gone(launcher)
    single_process_env()
    from megatron_kl.models import parallel
    from megatron_kl.rollout.engine import EngineLost
    from megatron_kl.rollout.http import Cancelled, ServerError
    from megatron_kl.rollout.servers import ServerStartFailed
    from megatron_kl.run.checkpoint import CheckpointError, CheckpointWriteError
    from megatron_kl.run.preemption import INTERRUPT_EXIT_CODE, REQUEUE_EXIT_CODE, Requeue, TrainingFailed
    from megatron_kl.run.run_dir import RunRefused
    from megatron_kl.train.loop import train
    from megatron_kl.train.warmstart import WarmStartStopped

    try:
        summary = train(cfg)
    except RunRefused as err:
        print(f"megatron-kl train: refused: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"megatron-kl train: config error: {err}", file=sys.stderr)
        return 2
    except Requeue as err:  # a checkpoint of the finished steps is on disk
        print(f"megatron-kl train: {err}", file=sys.stderr)
        return err.exit_code
    except (ServerStartFailed, ServerError) as err:  # permanent: a requeue would fail the same way
        print(f"megatron-kl train: rollout engine error: {err}", file=sys.stderr)
        return 1
    except TrainingFailed as err:  # after the finished steps were saved where they could be (the message says)
        kind = "rollout engine error" if isinstance(err.__cause__, (ServerStartFailed, ServerError)) else "failed"
        print(f"megatron-kl train: {kind}: {err}", file=sys.stderr)
        return 1
    except (CheckpointError, CheckpointWriteError) as err:
        print(f"megatron-kl train: {err}", file=sys.stderr)
        return 1
    except EngineLost as err:  # nothing was trained yet
        print(f"megatron-kl train: {err}", file=sys.stderr)
        return REQUEUE_EXIT_CODE
    except (Cancelled, WarmStartStopped) as err:  # a stop signal while starting (the warm start, the servers)
        code = INTERRUPT_EXIT_CODE if "SIGINT" in str(err) else REQUEUE_EXIT_CODE
        print(
            f"megatron-kl train: stopped while starting ({err}); nothing was trained; run the same command "
            f"again to start (exit code {code})",
            file=sys.stderr,
        )
        return code
    finally:
        parallel.destroy()
    if int(os.environ.get("RANK", "0")) == 0:
        if summary.already_finished:
            print(
                f"{summary.run_dir}: run {summary.run_name} already finished at step {summary.steps} with "
                "this configuration; nothing trained (raise train.steps to continue it). Its summary:"
            )
        else:
            logging.getLogger("megatron_kl.train").info(
                "done: metrics %s, TensorBoard %s, plots %s", summary.metrics, summary.tensorboard, summary.plots
            )
        for key in ("eval_before", "eval_after"):
            if getattr(summary, key):
                print(f"{key}: " + ", ".join(f"{k}={v:.3f}" for k, v in getattr(summary, key).items() if v is not None))
    return 0
