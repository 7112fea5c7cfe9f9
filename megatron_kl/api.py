"""Training from Python: load a configuration, build a Trainer, step it, read each step's result.

    from megatron_kl import api

    cfg = api.load_config("configs/cpu/default.yaml", ["train.steps=4", "kl.estimator=k3"])
    with api.trainer(cfg) as trainer:
        for step in range(trainer.start_step, cfg.train.steps):
            result = trainer.step(step)              # a StepResult: step, engine_version, metrics
            print(result.step, result.metrics["reward/mean"])
        trainer.save()                               # a checkpoint of the finished steps

    summary = api.train(cfg)                         # the whole run, as `megatron-kl train` (fit, evaluation, plots)

A reward function of your own is registered before the trainer is built and named in the config::

    from megatron_kl.rewards import RewardInput, register

    @register("short_answer")
    def short_answer(sample: RewardInput) -> float:
        return float(len(sample.response_ids) <= 8)

    cfg = api.load_config("configs/cpu/default.yaml", ["reward.functions=[{name: short_answer}]"])

Without torchrun the process becomes rank 0 of a world of one; under torchrun every rank runs the same code. The
configuration is checked as ``megatron-kl train --check`` checks it (a ConfigError names the field); a run directory
that already holds a finished run of this configuration is a ConfigError too (raise ``train.steps`` to continue it).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Iterator, Optional, Union

from megatron_kl.cli_help import quiet_optional_dependencies
from megatron_kl.config import ConfigError, apply_overrides, from_dict, read_yaml_file
from megatron_kl.rewards import RewardInput, RewardResult, register
from megatron_kl.train.cli import single_process_env
from megatron_kl.train.config import TrainConfig

__all__ = ["ConfigError", "RewardInput", "RewardResult", "TrainConfig", "load_config", "register", "train", "trainer"]


def load_config(source: Union[str, Path, dict, None] = None, overrides: Optional[list[str]] = None) -> TrainConfig:
    """A TrainConfig from a YAML file, a dict of sections (as the YAML would hold) or the defaults (None), with dotted
    overrides (``kl.coef=0.1``); validated as at load from the command line."""
    if source is None:
        data: dict = {}
    elif isinstance(source, dict):
        data = copy.deepcopy(source)
    else:
        data = read_yaml_file(source)
    return from_dict(TrainConfig, apply_overrides(data, list(overrides or [])))


@contextlib.contextmanager
def trainer(cfg: TrainConfig) -> Iterator["Trainer"]:  # noqa: F821 - megatron_kl.train.trainer.Trainer
    """The run's :class:`~megatron_kl.train.trainer.Trainer` (fresh, or resumed from the output directory's latest
    checkpoint), its process groups made and its directory locked; everything is shut down and released when the
    block ends."""
    from megatron_kl.models import parallel
    from megatron_kl.train.loop import prepare, seed_everything, started

    quiet_optional_dependencies()
    seed_everything(cfg.train.seed)
    prepared = prepare(cfg)
    if prepared.plan.kind == "finished":
        raise ConfigError(
            f"{prepared.config.train.output_dir}: this run finished at step "
            f"{prepared.plan.checkpoint_step}; raise train.steps to continue it, or set "
            "train.output_dir for a new run"
        )
    single_process_env()
    try:
        with started(prepared) as built:
            yield built
    finally:
        parallel.destroy()


def train(cfg: TrainConfig) -> "RunSummary":  # noqa: F821 - megatron_kl.run.summary.RunSummary
    """The whole run, as ``megatron-kl train`` runs it; its :class:`~megatron_kl.run.summary.RunSummary` (output
    paths, the evaluations before and after: ``summary.eval_after["eval/id/pass@1"]``)."""
    from megatron_kl.models import parallel
    from megatron_kl.train.loop import train as run

    single_process_env()
    try:
        return run(cfg)
    finally:
        parallel.destroy()
