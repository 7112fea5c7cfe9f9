"""The trainer: a run's stateful parts built and registered once, one RL step, the loop, saving and closing.

    with Trainer(cfg, plan, task, hf_source, topology, stop) as trainer:
        trainer.fit()

``__init__`` builds the policy (warm start, HF checkpoint or resumed), the frozen reference, the optimizer, the
rollout engine and source, and registers what a checkpoint holds in a :class:`RunState` (optimizer and
scheduler, counters, RNG states, the rollout source's queue), then resumes from the latest checkpoint when the
start plan says so. :meth:`step` runs one RL step (rollout -> reference and old passes -> KL-shaped advantages
-> updates -> weight sync) and logs its metrics; :meth:`fit` runs the steps with the evaluation and checkpoint
cadence and the stop signals; :meth:`save` writes the checkpoint of the finished steps. Leaving the ``with``
block shuts the rollout source and the engine down and closes the metrics logger, whatever ended the run; an
error inside :meth:`fit` becomes :class:`Requeue` (a stop signal, a lost engine: the finished steps saved, the
job to be started again) or :class:`TrainingFailed` (saved where the state is the finished steps').
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_kl.config import ConfigError, redact_secrets, to_dict
from megatron_kl.distill.teacher import build_teacher
from megatron_kl.models import builder, hf, moe_load, optim, output_head, parallel, state
from megatron_kl.models.offload import ReferenceOffload
from megatron_kl.rewards.scorer import RewardFailed, RewardScorer
from megatron_kl.rollout.engine import EngineLost
from megatron_kl.rollout.http import Cancelled
from megatron_kl.run import checkpoint as ckpt
from megatron_kl.run import run_dir
from megatron_kl.run.preemption import Requeue, StopSignals, TrainingFailed
from megatron_kl.run.run_state import Counters, RNGStates, RunState
from megatron_kl.train.checks import distill_verdict, kl_verdict
from megatron_kl.train.config import TrainConfig
from megatron_kl.train.engines import build_engine
from megatron_kl.train.evaluate import evaluate_all
from megatron_kl.train.metrics import MetricsLogger
from megatron_kl.train.profiling import StepProfiler, phase
from megatron_kl.train.rollouts import RolloutSource
from megatron_kl.train.step import NonFiniteUpdates, StepContext, rl_step
from megatron_kl.train.topology import Topology
from megatron_kl.train.warmstart import warm_start_state
from megatron_kl.vocab_parallel import triton_stats

log = logging.getLogger("megatron_kl.train")
# failures every rank raises at the same point (their condition is all-reduced), so a collective save is safe
AGREED_FAILURES = (NonFiniteUpdates, RewardFailed)


def _agreed_batch(source: RolloutSource, step: int):
    """The step's rollout batch; a reward failure (reward.on_failure=fail) on any rank is raised on every rank, before
    any collective of the step, so the finished steps can be saved collectively."""
    error = None
    try:
        batch = source.get(step)
    except RewardFailed as err:
        error, batch = err, None
    if dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if error is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ckpt.cpu_group())
        if float(flag) and error is None:
            raise RewardFailed(f"step {step}: a reward call failed on another rank (its log names it)")
    if error is not None:
        raise error
    return batch


def kl_tags(cfg: TrainConfig) -> dict:
    """Say once which gradient the KL term estimates (and what kl.estimator=auto chose); ``kl/biased`` for
    every step's metrics: 1 when the configuration is biased for kl.target in the run's regime."""
    if cfg.kl_selection is not None:
        log.info("kl.estimator=auto chose %s", cfg.kl_selection.describe())
    verdict = kl_verdict(cfg)
    sampling = cfg.rollout.sampling
    untruncated = sampling.distribution == "full" and sampling.truncates(cfg.model.vocab_size)
    if untruncated:
        log.warning(
            "rollout.sampling.distribution=full with top_k=%d / top_p=%g: the engines sample the truncated "
            "distribution mu while the trainer differentiates the full softmax, so the samples are off-policy "
            "and every KL estimate and the policy gradient are biased (the mismatch/* metrics show the gap); "
            "rollout.sampling.distribution=truncated trains mu itself",
            sampling.top_k,
            sampling.top_p,
        )
    if verdict is None:
        log.info("no KL term in the loss or reward (kl.coef=0 or algo.loss=rpg): kl.target is not judged")
        return {}
    if untruncated:
        return {"kl/biased": 1.0}
    if verdict.unbiased:
        log.info("KL term %s", verdict.describe())
    else:
        log.warning(
            "KL term %s; the run is tagged kl/biased=1 (kl.estimator=auto picks an unbiased one, "
            "kl.strict=true refuses biased runs; docs/kl-math.md)",
            verdict.describe(),
        )
    return {"kl/biased": 0.0 if verdict.unbiased else 1.0}


def distill_tags(cfg: TrainConfig) -> dict:
    """Say once which gradient the distillation term estimates; ``distill/biased`` for every step's metrics: 1 when
    it is biased for distill.kl.target in the run's regime (the audit judges it as it judges the reference term)."""
    if cfg.distill_selection is not None:
        log.info("distill.kl.estimator=auto chose %s", cfg.distill_selection.describe())
    verdict = distill_verdict(cfg)
    if verdict is None:
        return {}
    line = "distillation term (to the teacher) " + verdict.describe().replace("kl.target", "distill.kl.target")
    if verdict.unbiased:
        log.info(line)
    else:
        log.warning(
            "%s; the run is tagged distill/biased=1 (distill.kl.estimator=auto picks an unbiased one; "
            "docs/distillation.md)",
            line,
        )
    return {"distill/biased": 0.0 if verdict.unbiased else 1.0}


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One finished RL step: its index (0-based), the weight version the rollout engine holds after it (the RL steps
    finished), and the metrics it logged (names and units: docs/metrics.md)."""

    step: int
    engine_version: int
    metrics: dict


class Trainer:
    def __init__(
        self, cfg: TrainConfig, plan: run_dir.StartPlan, task, hf_source, topology: Topology, stop: StopSignals
    ):
        self.cfg, self.plan, self.task, self.hf_source, self.topology, self.stop = (
            cfg,
            plan,
            task,
            hf_source,
            topology,
            stop,
        )
        self.run_path = Path(cfg.train.output_dir)
        self.record = run_dir.run_record(cfg, plan)
        log.info("run %s (%s start) -> %s", cfg.run_name, plan.kind, self.run_path)

        initial = warm_start_state(cfg, task, stop.agreed) if hf_source is None else None
        models = builder.build_policy_and_reference(cfg.model, cfg.parallel)
        tp_group = topology.tp_group
        log.info(triton_stats.describe(parallel.collective_device()))
        if hf_source is not None:
            for chunks in (models.policy, models.reference):
                hf.load_hf_into(chunks, hf_source, cfg.model, tp_group)
            log.info("policy and reference loaded from %s", hf_source.path)
        elif initial is not None:
            for chunks in (models.policy, models.reference):
                state.load_full_state_dict(
                    chunks,
                    initial,
                    cfg.model.tie_word_embeddings,
                    dist.get_rank(tp_group),
                    dist.get_world_size(tp_group),
                )
        self.teacher = (
            build_teacher(cfg, task, topology, warm_start_state, stop.agreed) if cfg.distill.enabled else None
        )
        self.train_state = optim.build_train_state(models.policy, cfg.optim)
        self.engine = build_engine(cfg, self.train_state.chunks, hf_source, self.run_path, topology.dp_rank)
        try:
            self._register_and_resume(models)
        except BaseException:  # a start that fails here (a damaged checkpoint, say) leaves no server running
            if getattr(self, "source", None) is not None:
                self.source.close()
            self.engine.shutdown()
            raise

    def _register_and_resume(self, models) -> None:
        cfg, plan, topology = self.cfg, self.plan, self.topology
        self.scorer = RewardScorer.build(cfg.reward, self.task)  # reward.*: closed with the rollout source
        self.source = RolloutSource(
            self.task,
            self.engine,
            cfg.rollout.sampling,
            cfg.train.prompts_per_step,
            cfg.train.group_size,
            cfg.train.staleness,
            cfg.train.seed,
            topology.dp_rank,
            topology.dp_size,
            partial=cfg.rollout.partial,
            scorer=self.scorer,
        )
        offload = ReferenceOffload(models.reference, cfg.parallel.offload_reference)
        self.counters = Counters()
        # what a checkpoint holds: shared by every rank, or each rank's own
        self.run_state = RunState(
            self.train_state,
            shared={"scheduler": self.train_state.scheduler, "counters": self.counters},
            per_rank={"rng": RNGStates(), "rollouts": self.source},
        )
        self.context = StepContext(
            cfg,
            self.train_state,
            models.reference,
            output_head.ReferenceHead(models.reference),
            offload,
            topology,
            kl_tags={**kl_tags(cfg), **distill_tags(cfg)},
            counters=self.counters,
            expert_load=moe_load.expert_load(self.train_state.chunks, cfg.model),
            teacher=self.teacher,
        )

        latest = (
            ckpt.load_latest(self.run_path / "checkpoints", self.run_state, plan.run_id)
            if plan.kind == "resume"
            else None
        )
        self.start_step = self.counters.rl_steps
        if latest is not None:
            log.info(
                "resumed from %s at RL step %d (%d optimizer steps)",
                latest,
                self.start_step,
                self.counters.optimizer_steps,
            )
        if dist.get_rank() == 0 and plan.start_entry is not None:
            run_dir.record_start(self.run_path, plan.start_entry, self.start_step)
        logging_cfg = cfg.logging
        wandb = (
            {
                "project": logging_cfg.wandb_project,
                "entity": logging_cfg.wandb_entity,
                "tags": list(logging_cfg.wandb_tags),
                "mode": logging_cfg.wandb_mode,
                "id": plan.run_id,
            }
            if logging_cfg.wandb_project
            else None
        )
        self.logger = MetricsLogger(
            self.run_path,
            topology.is_logger,
            cfg.logging.tensorboard,
            wandb,
            cfg.run_name,
            redact_secrets(to_dict(cfg)),
            cfg.logging.progress,
            cfg.train.steps,
            self.start_step,
            cfg.logging.progress_every,
            cfg.logging.progress_every_s,
        )
        self.profiler = StepProfiler(cfg.logging.profile_steps, self.run_path / "profile", dist.get_rank())
        self.saved: dict[int, Path] = {self.start_step: latest} if latest is not None else {}
        self.boundary_optimizer_steps = self.counters.optimizer_steps  # when the last RL step finished
        self.engine_version: Optional[int] = None  # the policy version the engine holds (None: not synced yet)

    # -- context manager: whatever ends the run, the engine and its servers go down and the logger is closed --
    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Shut the rollout source, the engine and the logger down (once; later calls do nothing)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.source.close()
        self.engine.shutdown()
        self.logger.close()

    # -- one step, the loop --
    def evaluate(self, step: int) -> dict:
        cfg, start = self.cfg, time.perf_counter()
        sampling = cfg.rollout.sampling
        if cfg.eval.max_new_tokens:
            sampling = dataclasses.replace(sampling, max_new_tokens=cfg.eval.max_new_tokens)
        out = evaluate_all(
            self.engine,
            self.task,
            sampling,
            cfg.eval.k,
            cfg.eval.temperature,
            seed=cfg.train.seed * 31 + step,
            dp_rank=self.topology.dp_rank,
            dp_size=self.topology.dp_size,
            dp_group=self.topology.dp_group,
            scorer=self.scorer,
        )
        out["time/eval"] = time.perf_counter() - start
        return out

    def sync_engine(self) -> None:
        """Give the rollout engine the policy's current weights (version: the finished RL steps)."""
        self.engine.update_weights(self.train_state.chunks, version=self.counters.rl_steps)
        self.engine_version = self.counters.rl_steps

    def sync_metrics(self) -> dict:
        """weight_sync/*: what the last sync sent (rollout/delta.SyncStats; a served engine's on trainer rank 0)."""
        stats = self.engine.last_sync
        return stats.metrics() if stats is not None else {}

    def step(self, step: int) -> StepResult:
        """RL step ``step`` (0-based), its metrics logged; the engine holds the updated weights after it (and is
        given the current ones first if it has none yet)."""
        if self.engine_version is None:
            self.sync_engine()
        cfg, step_start, metrics = self.cfg, time.perf_counter(), {}
        if step == 0 or (cfg.eval.interval and step % cfg.eval.interval == 0):
            metrics.update(self.evaluate(step))
        with self.profiler.step(step):  # logging.profile_steps (train/profiling.py)
            with phase("rollout_wait", metrics):
                batch = _agreed_batch(self.source, step)
            metrics["time/rollout"] = batch.generate_seconds
            metrics.update(rl_step(self.context, batch, step))
            self.counters.rl_steps = step + 1  # its update is applied (optimizer steps: counters.optimizer_steps)
            self.boundary_optimizer_steps = self.counters.optimizer_steps
            try:
                with phase("weight_sync", metrics):  # time/weight_sync recorded even if it raises
                    with self.source.weight_update():  # finish, or pause and later resume, the generation in flight
                        self.sync_engine()
                metrics.update(self.sync_metrics())
            finally:  # the step is trained even if the servers are gone: its line is logged
                metrics["time/step"] = time.perf_counter() - step_start
                # training throughput: the step's evaluation (if any) is not part of it
                train_seconds = metrics["time/step"] - metrics.get("time/eval", 0.0)
                metrics["throughput/response_tokens"] = batch.num_response_tokens * self.topology.dp_size
                metrics["throughput/tokens_per_s"] = metrics["throughput/response_tokens"] / train_seconds
                self.logger.log(step, metrics)
                self.logger.advance(step + 1, metrics)
        return StepResult(step, self.engine_version, metrics)

    def fit(self) -> None:
        """The remaining steps with evaluation and checkpoint cadence, then the final evaluation. A stop signal or
        a lost engine raises :class:`Requeue`, any other error :class:`TrainingFailed` (module docstring)."""
        cfg = self.cfg
        try:
            self.sync_engine()
            signal_name = self.stop.agreed()
            if signal_name:
                raise self.requeue(f"received {signal_name} while starting", signal_name)
            for step in range(self.start_step, cfg.train.steps):
                self.step(step)
                done = self.counters.rl_steps
                if done == cfg.train.steps or (cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0):
                    self.save()
                signal_name = self.stop.agreed()
                if signal_name and done < cfg.train.steps:
                    raise self.requeue(f"received {signal_name}", signal_name)
            self.logger.log(cfg.train.steps, self.evaluate(cfg.train.steps))
        except Cancelled as err:  # a stop signal cut off the rollout or weight sync in flight
            self.source.drop_unfinished()
            signal_name = self.stop.agreed()
            raise self.requeue(f"{err}; the rollout in flight was cut off", signal_name) from err
        except EngineLost as err:
            self.source.drop_unfinished()
            raise self.requeue(f"rollout engine lost: {err}") from err
        except (Requeue, ConfigError, KeyboardInterrupt):
            raise
        except Exception as err:  # engine errors, NaN/inf aborts, anything unexpected: keep the finished steps
            raise self.failed(err) from err

    # -- saving, and what an ending saves --
    def save(self) -> Optional[Path]:
        """The checkpoint of the finished RL steps (written once; none for step 0: nothing to lose)."""
        done = self.counters.rl_steps
        if done not in self.saved and done > 0:
            # the generation in flight is finished first, outside the write: a stop signal or lost servers met
            # there end the run as such (75), never as a failed checkpoint write
            self.source.wait()
            cfg = self.cfg
            path = ckpt.save_checkpoint(
                self.run_path / "checkpoints",
                done,
                self.run_state,
                self.record,
                keep=cfg.checkpoint.keep,
                free_before_write=cfg.checkpoint.free_before_write,
            )
            if cfg.checkpoint.export_hf:
                hf_source = self.hf_source
                hf.export_hf(
                    [output_head.unwrap(c) for c in self.train_state.chunks],
                    cfg.model,
                    path / "hf",
                    dtype=hf_source.dtype if hf_source is not None else cfg.model.params_dtype,
                    tp_group=self.topology.tp_group,
                    pp_group=self.topology.pp_group,
                    source_dir=hf_source.path if hf_source is not None else None,
                )
            self.saved[done] = path
        return self.saved.get(done)

    def requeue(self, reason: str, signal_name: Optional[str] = None) -> Requeue:
        return Requeue(reason, self.counters.rl_steps, self.save(), signal_name)

    def failed(self, err: BaseException) -> TrainingFailed:
        """Save the finished steps before the error ends the run, where the state is theirs (no update of the
        unfinished step applied) and every rank is known to be here (one rank, or an error all ranks raise)."""
        done, counters = self.counters.rl_steps, self.counters
        complete = ckpt.complete_checkpoints(self.run_path / "checkpoints")
        last = complete[-1] if complete else None
        if done == 0 or done in self.saved:
            return TrainingFailed(err, done, self.saved.get(done), "no step finished" if done == 0 else "", last)
        if counters.optimizer_steps != self.boundary_optimizer_steps:
            return TrainingFailed(
                err,
                done,
                None,
                f"step {done + 1} had already applied "
                f"{counters.optimizer_steps - self.boundary_optimizer_steps} optimizer update(s)",
                last,
            )
        if dist.get_world_size() > 1 and not isinstance(err, AGREED_FAILURES):
            return TrainingFailed(err, done, None, "an error on some ranks only: a collective save could hang", last)
        self.source.drop_unfinished()
        try:
            return TrainingFailed(err, done, self.save())
        except Exception as save_error:  # noqa: BLE001 - the original error is the one to report
            return TrainingFailed(err, done, None, f"the save failed too: {save_error}", last)
