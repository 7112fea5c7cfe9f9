"""A run from its configuration: the checks that need no process group (``prepare``, also ``--check``), then the
process groups, the output directory's lock and the :class:`~megatron_kl.train.trainer.Trainer`, then the summary
and its plot."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_kl import child_processes, env_vars
from megatron_kl.config import ConfigError, to_dict, validate_parallel, validate_training_layout
from megatron_kl.distill.teacher import check_teacher
from megatron_kl.models import builder, context_parallel, hf, parallel
from megatron_kl.redaction import register_config
from megatron_kl.rewards.scorer import RewardScorer
from megatron_kl.run import checkpoint as ckpt
from megatron_kl.run import run_dir
from megatron_kl.run.host_malloc import tune_host_malloc
from megatron_kl.run.preemption import StopSignals
from megatron_kl.run.summary import RunSummary, read_summary
from megatron_kl.tasks import build_task
from megatron_kl.tasks.dataset import TaskContext
from megatron_kl.train.checks import validate_train_config
from megatron_kl.train.config import TrainConfig
from megatron_kl.train.metric_registry import canonical_record
from megatron_kl.train.metrics import read_metrics, wandb_missing
from megatron_kl.train.plots import write_training_plot
from megatron_kl.train.topology import Topology
from megatron_kl.train.trainer import Trainer
from megatron_kl.train.warmstart import shipped_entry

log = logging.getLogger("megatron_kl.train")


def seed_everything(seed: int) -> None:
    """Model initialisation (megatron's CPU init draws from torch's global generator) and host RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _hf_source(cfg: TrainConfig):
    """The init HF checkpoint (None without one)."""
    if cfg.init.hf_checkpoint is None:
        return None
    try:
        checkpoint = hf.HFCheckpoint(cfg.init.hf_checkpoint)
        checkpoint.check_shapes()  # a damaged file or a config.json the weights disagree with, named at --check
        return checkpoint
    except hf.HFCheckpointError as err:
        raise ConfigError(f"init.hf_checkpoint={cfg.init.hf_checkpoint}: {err}") from None
    except FileNotFoundError as err:
        raise ConfigError(
            f"init.hf_checkpoint={cfg.init.hf_checkpoint}: {err}; give an HF model directory (write one "
            "with `megatron-kl convert --megatron CKPT --out DIR` or `--gguf FILE --out DIR`)"
        ) from None


def resolve(cfg: TrainConfig, task, hf_source) -> TrainConfig:
    """The configuration the run uses, as a new object (``cfg`` is left as loaded): the model section checked
    against and completed from the init HF checkpoint, and the stop tokens when none are given (the tokenizer's eos
    and the checkpoint's). What loading resolved already (``kl.estimator=auto``'s choice, ``{run_name}`` in the
    output directory, the Dr. GRPO length) is kept."""
    model = hf.model_config_for_run(cfg.model, hf_source) if hf_source is not None else cfg.model
    sampling = cfg.rollout.sampling
    if not sampling.stop_token_ids:
        sampling = dataclasses.replace(sampling, stop_token_ids=default_stop_token_ids(task, hf_source))
    return cfg.with_sections(model=model, rollout=dataclasses.replace(cfg.rollout, sampling=sampling))


def default_stop_token_ids(task, hf_source) -> list[int]:
    """The tokenizer's eos, plus every eos id of the init checkpoint's generation_config.json (chat models stop
    at end-of-turn tokens that are not the tokenizer's eos)."""
    ids = [task.tokenizer.eos_id]
    if hf_source is not None:
        ids += [i for i in hf_source.eos_token_ids() if i not in ids]
    return ids


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _claim(cfg: TrainConfig, plan: run_dir.StartPlan, world_size: int) -> Optional[run_dir.RunLock]:
    """Rank 0 takes the output directory's lock and prepares it for this start (run/run_dir.py); every
    rank learns the outcome before anything is written. Raises RunRefused on every rank."""
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            lock = run_dir.RunLock(Path(cfg.train.output_dir))
            again = run_dir.plan_start(cfg, world_size, plan.identity)  # under the lock: another writer?
            if (again.kind, again.checkpoint_step) != (plan.kind, plan.checkpoint_step):
                raise run_dir.RunRefused(
                    f"{cfg.train.output_dir} changed while this run started (another trainer "
                    "wrote to it); run the command again"
                )
            run_dir.begin(cfg, plan, world_size)
        except run_dir.RunRefused as err:
            error = str(err)
    message = [error]
    if world_size > 1:
        dist.broadcast_object_list(message, src=0, group=ckpt.cpu_group())
    if message[0] is not None:
        if lock is not None:
            lock.release()
        raise run_dir.RunRefused(message[0])
    return lock


@dataclasses.dataclass
class Prepared:
    """What a start decides from the configuration alone (no process group, server, model or file written)."""

    config: TrainConfig  # resolved (:func:`resolve`)
    world_size: int
    hf_source: object
    task: object
    plan: run_dir.StartPlan
    notes: list[str] = dataclasses.field(default_factory=list)  # what the run does that the user may not expect


def prepare(cfg: TrainConfig) -> Prepared:
    """Every check the configuration alone decides - values, combinations, layout vs the world size, tokenizer
    vs model vocabulary, files that must exist - on the resolved configuration, and the start plan (fresh / resume
    / finished / refused). Raises ConfigError (RunRefused) naming the fields; touches nothing, ``cfg`` and the
    random generators included (``megatron-kl train --check``)."""
    try:
        env_vars.check_environment()  # a misspelt MEGATRON_KL_* variable names itself before anything starts
    except env_vars.EnvVarError as err:
        raise ConfigError(str(err)) from None
    world_size = _world_size()
    hf_source = _hf_source(cfg)
    task = build_task(cfg.task, task_context(cfg, hf_source))
    given_stops = list(cfg.rollout.sampling.stop_token_ids)
    cfg = resolve(cfg, task, hf_source)
    notes = check_against_task(cfg, task, hf_source, given_stops)
    validate_parallel(cfg.model, cfg.parallel, world_size)
    validate_training_layout(cfg.model, cfg.parallel, cfg.train.micro_batch_tokens)
    model_parallel = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel * cfg.parallel.context_parallel
    validate_train_config(cfg, task.tokenizer.vocab_size, world_size // model_parallel)
    context_parallel.check_runnable(cfg.parallel, builder.have_transformer_engine())  # where it can run at all
    RewardScorer.build(cfg.reward, task).close()  # reward functions that resolve to nothing are refused here
    if hf_source is None:
        shipped_entry(cfg)  # a damaged shipped manifest, or source=shipped without one, is named here
    if cfg.distill.enabled:
        _check_teacher(cfg, task)
    missing = wandb_missing(cfg.logging.wandb_project)
    if missing:
        raise ConfigError(missing)
    return Prepared(cfg, world_size, hf_source, task, run_dir.plan_start(cfg, world_size), notes)


def _check_teacher(cfg: TrainConfig, task) -> None:
    """The teacher's architecture, vocabulary and layout (distill/teacher.check_teacher), and its positions against
    the longest sequence it will score."""
    teacher = check_teacher(cfg, _world_size())
    longest = task.longest_prompt_tokens() + cfg.rollout.sampling.max_new_tokens
    if teacher is not None and longest > teacher.max_position_embeddings:
        raise ConfigError(
            f"distill.teacher holds {teacher.max_position_embeddings} positions but scores sequences of "
            f"up to {longest} tokens (the longest prompt + rollout.sampling.max_new_tokens); use a "
            "teacher with more positions or shorten the responses"
        )


def check_against_task(cfg: TrainConfig, task, hf_source, given_stops: list[int]) -> list[str]:
    """Values checked against what they refer to: stop-token ids against the vocabulary, the longest prompt plus
    the longest response asked for against the model's positions. Returns notes on what a user may not expect (a
    stop list that replaces the end-of-sequence ids)."""
    vocab = cfg.model.vocab_size
    outside = [i for i in cfg.rollout.sampling.stop_token_ids if not 0 <= i < vocab]
    if outside:
        raise ConfigError(
            f"rollout.sampling.stop_token_ids={list(cfg.rollout.sampling.stop_token_ids)}: {outside} "
            f"outside the vocabulary (ids 0..{vocab - 1}, model.vocab_size={vocab}): no sampled token "
            "could ever stop a response; give token ids of the tokenizer (or [] for its end-of-sequence)"
        )
    notes = []
    defaults = default_stop_token_ids(task, hf_source)
    dropped = [i for i in defaults if i not in given_stops]
    if given_stops and dropped:
        notes.append(
            f"rollout.sampling.stop_token_ids={given_stops} replaces the end-of-sequence id(s) {dropped} "
            f"(the tokenizer's and the checkpoint's): a response stops only at the given ids or at "
            f"max_new_tokens; add {dropped} to the list to stop at the end of sequence too"
        )
    longest, positions = task.longest_prompt_tokens(), cfg.model.max_position_embeddings
    for name, tokens in (
        ("rollout.sampling.max_new_tokens", cfg.rollout.sampling.max_new_tokens),
        ("eval.max_new_tokens", cfg.eval.max_new_tokens),
    ):
        if tokens is not None and longest + tokens > positions:
            raise ConfigError(
                f"{name}={tokens} with the task's longest prompt ({longest} tokens) needs "
                f"{longest + tokens} positions, more than model.max_position_embeddings={positions}: "
                f"lower {name} to at most {positions - longest}, or shorten the prompts"
            )
    return notes


def task_context(cfg: TrainConfig, hf_source) -> TaskContext:
    """What the task needs from the rest of the config: the init checkpoint (the default tokenizer) and the longest
    prompt the model takes (its positions minus the longest response asked for)."""
    model = hf.model_config_for_run(cfg.model, hf_source) if hf_source is not None else cfg.model
    response = max(cfg.rollout.sampling.max_new_tokens, cfg.eval.max_new_tokens or 0)
    return TaskContext(
        hf_checkpoint=cfg.init.hf_checkpoint, prompt_token_limit=model.max_position_embeddings - response
    )


def train(cfg: TrainConfig) -> RunSummary:
    """Run (or resume) the training the configuration describes; its summary (also ``summary.json``)."""
    seed_everything(cfg.train.seed)  # model initialisation and the task's data draw from the global generators
    register_config(to_dict(cfg))  # its secrets never reach a line written (megatron_kl/redaction.py)
    prepared = prepare(cfg)  # a refused start changes nothing (run/run_dir.py)
    cfg = prepared.config
    for note in prepared.notes:
        log.warning(note)
    if prepared.plan.kind == "finished":
        return dataclasses.replace(read_summary(Path(cfg.train.output_dir), canonical_record), already_finished=True)
    with started(prepared) as trainer:
        trainer.fit()
        trainer.close()  # metrics written and the engine down before the summary reads them (the lock still held)
        return _summary(cfg, prepared.plan.run_id, Path(cfg.train.output_dir), trainer.topology.is_logger)


@contextlib.contextmanager
def started(prepared: Prepared) -> Iterator[Trainer]:
    """The Trainer of a prepared start (fresh or resume), with the stop signals installed, the process groups made and
    the output directory's lock held; leaving the block closes the trainer (engine, servers, logger) and releases the
    lock and the signals. The caller seeds first (:func:`seed_everything`) and destroys the process groups when done
    (``parallel.destroy``)."""
    cfg, plan = prepared.config, prepared.plan
    stop = StopSignals(cfg.train.stop_signals)  # from here on a stop signal ends the run cleanly
    lock = None
    try:
        tune_host_malloc(cfg.train.host_malloc)
        child_processes.install()  # helpers forked from here on die with this process
        parallel.initialize(cfg.model, cfg.parallel, seed=cfg.train.seed)
        topology = Topology.from_parallel_state()
        lock = _claim(cfg, plan, prepared.world_size)
        with Trainer(cfg, plan, prepared.task, prepared.hf_source, topology, stop) as trainer:
            yield trainer
    finally:
        stop.close()
        if lock is not None:
            lock.release()


def _summary(cfg: TrainConfig, run_id: str, run_path: Path, is_logger: bool) -> RunSummary:
    summary = RunSummary(
        cfg.run_name,
        run_id,
        cfg.train.steps,
        str(run_path),
        str(run_path / "metrics.jsonl"),
        str(run_path / "tensorboard"),
        str(run_path / "plots"),
    )
    if is_logger:
        records = read_metrics(run_path / "metrics.jsonl")
        evals = [r for r in records if "eval/id/pass@1" in r]
        if evals:
            summary = dataclasses.replace(
                summary,
                eval_before={k: v for k, v in evals[0].items() if k.startswith("eval/")},
                eval_after={k: v for k, v in evals[-1].items() if k.startswith("eval/")},
            )
        plots = write_training_plot(records, run_path / "plots", f"{cfg.run_name} ({run_path})")
        summary = dataclasses.replace(summary, plots=str(plots))
        summary.write(run_path / "summary.json")
    dist.barrier()
    return summary
