"""The main training loop: rollout -> reward -> KL -> update -> weight sync, with eval and checkpoints."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megatron_kl import child_processes
from megatron_kl.config import ConfigError, redact_secrets, to_dict, validate_parallel, validate_training_layout
from megatron_kl.kl import triton_stats
from megatron_kl.models import builder, context_parallel, hf, moe_load, optim, output_head, parallel, pipeline, state
from megatron_kl.models.offload import ReferenceOffload
from megatron_kl.tasks import build_task
from megatron_kl.train import checkpoint as ckpt
from megatron_kl.train import run_dir
from megatron_kl.train.config import TrainConfig, kl_verdict, validate_train_config
from megatron_kl.train.engines import build_engine
from megatron_kl.train.host_malloc import tune_host_malloc
from megatron_kl.train.evaluate import evaluate_all
from megatron_kl.rollout.engine import EngineLost
from megatron_kl.rollout.http import Cancelled
from megatron_kl.train.metrics import MetricsLogger, read_metrics
from megatron_kl.train.preemption import Requeue, StopSignals, TrainingFailed
from megatron_kl.train.profiling import StepProfiler, phase
from megatron_kl.train.rollouts import RolloutSource
from megatron_kl.train.run_state import Counters, RNGStates, RunState
from megatron_kl.train.step import NonFiniteUpdates, StepContext, rl_step
from megatron_kl.train.warmstart import warm_start_state

log = logging.getLogger("megatron_kl.train")
# failures every rank raises at the same point (their condition is all-reduced), so a collective save is safe
AGREED_FAILURES = (NonFiniteUpdates,)


def _topology():
    from megatron.core import parallel_state as ps

    dp_group = ps.get_data_parallel_group()
    is_logger = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(), dist.get_world_size(dp_group), dp_group, is_logger


def _evaluate_all(cfg: TrainConfig, engine, task, step: int, dp) -> dict:
    start = time.perf_counter()
    sampling = cfg.rollout.sampling
    if cfg.eval.max_new_tokens:
        sampling = dataclasses.replace(sampling, max_new_tokens=cfg.eval.max_new_tokens)
    out = evaluate_all(engine, task, sampling, cfg.eval.k, cfg.eval.temperature, seed=cfg.train.seed * 31 + step,
                       dp_rank=dp[0], dp_size=dp[1], dp_group=dp[2])
    out["time/eval"] = time.perf_counter() - start
    return out


def seed_everything(seed: int) -> None:
    """Model initialisation (megatron's CPU init draws from torch's global generator) and host RNGs."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _hf_source(cfg: TrainConfig):
    """The init HF checkpoint, with the run's model config checked against (and completed from) it."""
    if cfg.init.hf_checkpoint is None:
        return None
    try:
        checkpoint = hf.HFCheckpoint(cfg.init.hf_checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(f"init.hf_checkpoint={cfg.init.hf_checkpoint}: {err}; give an HF model directory (write one "
                          "with `megatron-kl convert --megatron CKPT --out DIR` or `--gguf FILE --out DIR`)") from None
    cfg.model = hf.model_config_for_run(cfg.model, checkpoint)
    return checkpoint


def default_stop_token_ids(task, hf_source) -> list[int]:
    """The tokenizer's eos, plus every eos id of the init checkpoint's generation_config.json (chat models stop
    at end-of-turn tokens that are not the tokenizer's eos)."""
    ids = [task.tokenizer.eos_id]
    if hf_source is not None:
        ids += [i for i in hf_source.eos_token_ids() if i not in ids]
    return ids


def kl_tags(cfg: TrainConfig) -> dict:
    """Say once which gradient the KL term estimates (and what kl.estimator=auto chose); ``kl/biased`` for
    every step's metrics: 1 when the configuration is biased for kl.target in the run's regime."""
    if cfg.kl_selection is not None:
        log.info("kl.estimator=auto chose %s", cfg.kl_selection.describe())
    verdict = kl_verdict(cfg)
    sampling = cfg.rollout.sampling
    untruncated = sampling.distribution == "full" and sampling.truncates(cfg.model.vocab_size)
    if untruncated:
        log.warning("rollout.sampling.distribution=full with top_k=%d / top_p=%g: the engines sample the truncated "
                    "distribution mu while the trainer differentiates the full softmax, so the samples are off-policy "
                    "and every KL estimate and the policy gradient are biased (the mismatch/* metrics show the gap); "
                    "rollout.sampling.distribution=truncated trains mu itself", sampling.top_k, sampling.top_p)
    if verdict is None:
        log.info("no KL term in the loss or reward (kl.coef=0 or algo.loss=rpg): kl.target is not judged")
        return {}
    if untruncated:
        return {"kl/biased": 1.0}
    if verdict.unbiased:
        log.info("KL term %s", verdict.describe())
    else:
        log.warning("KL term %s; the run is tagged kl/biased=1 (kl.estimator=auto picks an unbiased one, "
                    "kl.strict=true refuses biased runs; docs/kl-math.md)", verdict.describe())
    return {"kl/biased": 0.0 if verdict.unbiased else 1.0}


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _claim(cfg: TrainConfig, plan: run_dir.StartPlan, world_size: int) -> Optional[run_dir.RunLock]:
    """Rank 0 takes the output directory's lock and prepares it for this start (train/run_dir.py); every
    rank learns the outcome before anything is written. Raises RunRefused on every rank."""
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            lock = run_dir.RunLock(Path(cfg.train.output_dir))
            again = run_dir.plan_start(cfg, world_size, plan.identity)  # under the lock: another writer?
            if (again.kind, again.checkpoint_step) != (plan.kind, plan.checkpoint_step):
                raise run_dir.RunRefused(f"{cfg.train.output_dir} changed while this run started (another trainer "
                                         "wrote to it); run the command again")
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

    world_size: int
    hf_source: object
    task: object
    plan: run_dir.StartPlan


def prepare(cfg: TrainConfig) -> Prepared:
    """Every check the configuration alone decides - values, combinations, layout vs the world size, tokenizer
    vs model vocabulary, files that must exist - and the start plan (fresh / resume / finished / refused).
    Raises ConfigError (RunRefused) naming the fields; touches nothing (``megatron-kl train --check``)."""
    world_size = _world_size()
    hf_source = _hf_source(cfg)
    seed_everything(cfg.train.seed)
    task = build_task(cfg.task)
    if not cfg.rollout.sampling.stop_token_ids:
        cfg.rollout.sampling.stop_token_ids = default_stop_token_ids(task, hf_source)
    validate_parallel(cfg.model, cfg.parallel, world_size)
    validate_training_layout(cfg.model, cfg.parallel, cfg.train.micro_batch_tokens)
    model_parallel = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel * cfg.parallel.context_parallel
    validate_train_config(cfg, task.tokenizer.vocab_size, world_size // model_parallel)
    context_parallel.check_runnable(cfg.parallel, builder.have_transformer_engine())  # where it can run at all
    return Prepared(world_size, hf_source, task, run_dir.plan_start(cfg, world_size))


def train(cfg: TrainConfig) -> dict:
    prepared = prepare(cfg)  # a refused start changes nothing (train/run_dir.py)
    world_size, hf_source, task, plan = (prepared.world_size, prepared.hf_source, prepared.task, prepared.plan)
    if plan.kind == "finished":
        return {**run_dir.read_summary(Path(cfg.train.output_dir)), "already_finished": True}
    stop = StopSignals(cfg.train.stop_signals)  # from here on a stop signal ends the run cleanly
    lock = None
    try:
        tune_host_malloc(cfg.train.host_malloc)
        child_processes.install()  # helpers forked from here on die with this process
        parallel.initialize(cfg.model, cfg.parallel, seed=cfg.train.seed)
        dp_rank, dp_size, dp_group, is_logger = _topology()
        lock = _claim(cfg, plan, world_size)
        return _train(cfg, plan, task, hf_source, (dp_rank, dp_size, dp_group), is_logger, stop)
    finally:
        stop.close()
        if lock is not None:
            lock.release()


def _train(cfg: TrainConfig, plan, task, hf_source, dp, is_logger: bool, stop: StopSignals) -> dict:
    dp_rank, dp_size, dp_group = dp
    run_path = Path(cfg.train.output_dir)
    record = run_dir.run_record(cfg, plan)
    log.info("run %s (%s start) -> %s", cfg.run_name, plan.kind, run_path)

    initial = warm_start_state(cfg, task, stop.agreed) if hf_source is None else None
    models = builder.build_policy_and_reference(cfg.model, cfg.parallel)
    tp_group = parallel.tp_group()
    log.info(triton_stats.describe(parallel.collective_device()))
    if hf_source is not None:
        for chunks in (models.policy, models.reference):
            hf.load_hf_into(chunks, hf_source, cfg.model, tp_group)
        log.info("policy and reference loaded from %s", hf_source.path)
    elif initial is not None:
        for chunks in (models.policy, models.reference):
            state.load_full_state_dict(chunks, initial, cfg.model.tie_word_embeddings, dist.get_rank(tp_group),
                                       dist.get_world_size(tp_group))
    train_state = optim.build_train_state(models.policy, cfg.optim)
    engine = build_engine(cfg, train_state.chunks, hf_source, run_path, dp_rank)
    source = RolloutSource(task, engine, cfg.rollout.sampling, cfg.train.prompts_per_step, cfg.train.group_size,
                           cfg.train.staleness, cfg.train.seed, dp_rank, dp_size)
    offload = ReferenceOffload(models.reference, cfg.parallel.offload_reference)
    counters = Counters()
    run_state = RunState(train_state, shared={"scheduler": train_state.scheduler, "counters": counters},
                         per_rank={"rng": RNGStates(), "rollouts": source})
    ctx = StepContext(cfg, train_state, models.reference, output_head.ReferenceHead(models.reference), offload, dp_group,
                      kl_tags=kl_tags(cfg), counters=counters, pp_group=parallel.pp_group(), tp_group=tp_group,
                      cp_group=pipeline.context_parallel_group(),
                      expert_load=moe_load.expert_load(train_state.chunks, cfg.model))

    latest = ckpt.load_latest(run_path / "checkpoints", run_state, plan.run_id) if plan.kind == "resume" else None
    start_step = counters.rl_steps
    if latest is not None:
        log.info("resumed from %s at RL step %d (%d optimizer steps)", latest, start_step, counters.optimizer_steps)
    if dist.get_rank() == 0 and plan.start_entry is not None:
        run_dir.record_start(run_path, plan.start_entry, start_step)

    logger = MetricsLogger(run_path, is_logger, cfg.logging.tensorboard, cfg.logging.wandb_project, cfg.run_name,
                           redact_secrets(to_dict(cfg)), cfg.logging.progress, cfg.train.steps, start_step)
    profiler = StepProfiler(cfg.logging.profile_steps, run_path / "profile", dist.get_rank())
    saved = {start_step: latest} if latest is not None else {}

    def save() -> Optional[Path]:
        """The checkpoint of the finished RL steps (written once; none for step 0: nothing to lose)."""
        done = counters.rl_steps
        if done not in saved and done > 0:
            saved[done] = _save_checkpoint(cfg, record, done, run_state, hf_source, tp_group)
        return saved.get(done)

    def requeue(reason: str, signal_name: Optional[str] = None) -> Requeue:
        return Requeue(reason, counters.rl_steps, save(), signal_name)

    boundary = {"optimizer_steps": counters.optimizer_steps}  # optimizer steps when the last RL step finished

    def failed(err: BaseException) -> TrainingFailed:
        """Save the finished steps before the error ends the run, where the state is theirs (no update of the
        unfinished step applied) and every rank is known to be here (one rank, or an error all ranks raise)."""
        done = counters.rl_steps
        complete = ckpt.complete_checkpoints(run_path / "checkpoints")
        last = complete[-1] if complete else None
        if done == 0 or done in saved:
            return TrainingFailed(err, done, saved.get(done), "no step finished" if done == 0 else "", last)
        if counters.optimizer_steps != boundary["optimizer_steps"]:
            return TrainingFailed(err, done, None, f"step {done + 1} had already applied "
                                  f"{counters.optimizer_steps - boundary['optimizer_steps']} optimizer update(s)", last)
        if dist.get_world_size() > 1 and not isinstance(err, AGREED_FAILURES):
            return TrainingFailed(err, done, None, "an error on some ranks only: a collective save could hang", last)
        source.drop_unfinished()
        try:
            return TrainingFailed(err, done, save())
        except Exception as save_error:  # noqa: BLE001 - the original error is the one to report
            return TrainingFailed(err, done, None, f"the save failed too: {save_error}", last)

    try:
        try:
            engine.update_weights(train_state.chunks, version=start_step)
            signal_name = stop.agreed()
            if signal_name:
                raise requeue(f"received {signal_name} while starting", signal_name)
            for step in range(start_step, cfg.train.steps):
                step_start = time.perf_counter()
                metrics = {}
                if step == 0 or (cfg.eval.interval and step % cfg.eval.interval == 0):
                    metrics.update(_evaluate_all(cfg, engine, task, step, dp))
                with profiler.step(step):  # logging.profile_steps (train/profiling.py)
                    with phase("rollout_wait", metrics):
                        batch = source.get(step)
                    metrics["time/rollout"] = batch.generate_seconds
                    metrics.update(rl_step(ctx, batch, step))
                    counters.rl_steps = step + 1  # its update is applied (optimizer steps: counters.optimizer_steps)
                    boundary["optimizer_steps"] = counters.optimizer_steps
                    try:
                        with phase("weight_sync", metrics):  # time/weight_sync recorded even if it raises
                            source.wait()
                            engine.update_weights(train_state.chunks, version=counters.rl_steps)
                    finally:  # the step is trained even if the servers are gone: its line is logged
                        metrics["time/step"] = time.perf_counter() - step_start
                        # training throughput: the step's evaluation (if any) is not part of it
                        train_seconds = metrics["time/step"] - metrics.get("time/eval", 0.0)
                        metrics["throughput/response_tokens"] = batch.num_response_tokens * dp_size
                        metrics["throughput/tokens_per_s"] = metrics["throughput/response_tokens"] / train_seconds
                        logger.log(step, metrics)
                        logger.advance(step + 1, metrics)
                done = counters.rl_steps
                if done == cfg.train.steps or (cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0):
                    save()
                signal_name = stop.agreed()
                if signal_name and done < cfg.train.steps:
                    raise requeue(f"received {signal_name}", signal_name)
            final = _evaluate_all(cfg, engine, task, cfg.train.steps, dp)
            logger.log(cfg.train.steps, final)
        except Cancelled as err:  # a stop signal cut off the rollout or weight sync in flight
            source.drop_unfinished()
            signal_name = stop.agreed()
            raise requeue(f"{err}; the rollout in flight was cut off", signal_name) from err
        except EngineLost as err:
            source.drop_unfinished()
            raise requeue(f"rollout engine lost: {err}") from err
        except (Requeue, ConfigError, KeyboardInterrupt):
            raise
        except Exception as err:  # engine errors, NaN/inf aborts, anything unexpected: keep the finished steps
            raise failed(err) from err
    finally:
        source.close()
        engine.shutdown()
        logger.close()
    return _summary(cfg, plan.run_id, run_path, is_logger)


def _save_checkpoint(cfg: TrainConfig, record: dict, done: int, run_state: RunState, hf_source, tp_group) -> Path:
    path = ckpt.save_checkpoint(Path(cfg.train.output_dir) / "checkpoints", done, run_state, record,
                                keep=cfg.checkpoint.keep, free_before_write=cfg.checkpoint.free_before_write)
    if cfg.checkpoint.export_hf:
        hf.export_hf([output_head.unwrap(c) for c in run_state.train_state.chunks], cfg.model, path / "hf",
                     dtype=hf_source.dtype if hf_source is not None else cfg.model.params_dtype,
                     tp_group=tp_group, pp_group=parallel.pp_group(),
                     source_dir=hf_source.path if hf_source is not None else None)
    return path


def _summary(cfg: TrainConfig, run_id: str, run_path: Path, is_logger: bool) -> dict:
    summary = {"run_name": cfg.run_name, "run_id": run_id, "steps": cfg.train.steps, "run_dir": str(run_path),
               "metrics": str(run_path / "metrics.jsonl"),
               "tensorboard": str(run_path / "tensorboard"), "plots": str(run_path / "plots")}
    if is_logger:
        records = read_metrics(run_path / "metrics.jsonl")
        evals = [r for r in records if "eval/id/pass@1" in r]
        if evals:
            summary["eval_before"] = {k: v for k, v in evals[0].items() if k.startswith("eval/")}
            summary["eval_after"] = {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
        summary["plots"] = _plots(records, run_path / "plots")
        (run_path / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    return summary


def _plots(records: list[dict], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plots)"
    out.mkdir(parents=True, exist_ok=True)
    panels = [("reward/mean", "kl/exact_token", "kl/k1_token", "kl/k3_token"), ("eval/id/pass@1", "eval/ood/pass@1")]
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.5))
    for ax, keys in zip(axes, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=key, marker="." if key.startswith("eval") else None)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=100)
    plt.close(fig)
    return str(out / "training.png")
