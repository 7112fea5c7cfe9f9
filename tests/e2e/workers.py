"""Rank functions for the end-to-end tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_kl.config import from_dict
from megatron_kl.train.config import TrainConfig


def train_worker(rank, world, cfg_dict: dict):
    from megatron_kl.train.loop import train
    from megatron_kl.train.metrics import read_metrics

    cfg = from_dict(TrainConfig, cfg_dict)
    summary = train(cfg)
    dist.barrier()
    return {"summary": summary, "metrics": read_metrics(f"{cfg.train.output_dir}/metrics.jsonl")}


def _seeded_policy(model_dict: dict, tp: int):
    """A policy (and reference) at TP=``tp`` and ``load(seed)``, which gives the policy seeded random weights, the
    same full state in every layout (sharded here)."""
    from megatron_kl.config import ModelConfig, ParallelConfig
    from megatron_kl.models import builder, parallel, state

    model = from_dict(ModelConfig, model_dict)
    layout = ParallelConfig(tensor_parallel=tp)
    torch.manual_seed(0)
    parallel.initialize(model, layout)
    models = builder.build_policy_and_reference(model, layout)
    tp_group = parallel.tp_group()
    full = state.full_state_dict(models.policy, model.vocab_size, False, tp_group, parallel.pp_group())

    def load(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        weights = {k: torch.randn(v.shape, generator=generator) * 0.3 for k, v in full.items()}
        state.load_full_state_dict(models.policy, weights, False, dist.get_rank(tp_group), tp)

    return model, layout, models, load


def engine_worker(rank, world, model_dict: dict, tp: int, prompts, sampling_dict: dict):
    """Generate from a fixed random policy; return completions and the trainer's recomputed log-probs."""
    from megatron_kl.models import pipeline
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.local import LocalEngine
    from megatron_kl.train.batching import pack

    model, layout, models, load = _seeded_policy(model_dict, tp)
    load(5)  # identical weights in every layout
    engine = LocalEngine(model, layout)
    engine.update_weights(models.policy, version=7)
    sampling = from_dict(SamplingConfig, sampling_dict)
    completions = engine.generate(prompts, sampling, seed=11)
    tokens, mask, behavior = pack(
        prompts, [c.response_ids for c in completions], 0, per_token=[c.response_logprobs for c in completions]
    )
    stats = pipeline.compute_token_stats(
        models.policy,
        pipeline.SequenceBatch(tokens, mask),
        1,
        pipeline.VocabOptions(model.vocab_size, sampling.logprob_temperature),
    )
    # the same generation with every row prefilled on its own (no shared prefill of repeated prompts)
    engine._prefill = engine._prefill_rows
    every_row = engine.generate(prompts, sampling, seed=11)
    # megatron's own static-batching decode (keys cached before RoPE, all re-rotated every step)
    megatron_decode = LocalEngine(model, layout, flash_decode=False)
    megatron_decode.update_weights(models.policy, version=7)
    return {
        "completions": completions,
        "recomputed": stats.logprobs,
        "behavior": behavior,
        "mask": mask,
        "every_row": every_row,
        "megatron_decode": megatron_decode.generate(prompts, sampling, seed=11),
        "cache_dtype": engine.cache_dtype,
    }


def offload_worker(rank, world, model_dict: dict):
    """Reference log-probs with offload on == off; weights back on the host after each pass."""
    from megatron_kl.config import ModelConfig, ParallelConfig
    from megatron_kl.models import builder, parallel, pipeline
    from megatron_kl.models.offload import ReferenceOffload

    model = from_dict(ModelConfig, model_dict)
    layout = ParallelConfig()
    parallel.initialize(model, layout)
    models = builder.build_policy_and_reference(model, layout)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    for chunk in models.reference + models.policy:
        chunk.to(device)
    tokens = torch.randint(0, model.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = pipeline.SequenceBatch(tokens, torch.ones(4, 11))
    vocab = pipeline.VocabOptions(model.vocab_size)
    resident = pipeline.compute_token_stats(models.reference, batch, 1, vocab).logprobs
    offload = ReferenceOffload(models.reference, enabled=True)
    host_between = offload.on_host
    with offload.resident():
        offloaded = pipeline.compute_token_stats(models.reference, batch, 1, vocab).logprobs
    return {
        "resident": resident,
        "offloaded": offloaded,
        "host_between": host_between,
        "host_after": offload.on_host,
        "enabled": offload.enabled,
    }


def shared_engine_worker(rank, world, model_dict: dict, prompts, sampling_dict: dict):
    """A replica sharing the policy's tensors vs one holding a copy: same tokens; in-place policy updates
    reach the sharing replica without a copy; a replaced policy tensor is followed at the next sync."""
    from megatron_kl.config import ModelConfig, ParallelConfig
    from megatron_kl.models import builder, parallel
    from megatron_kl.models.output_head import unwrap
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.local import LocalEngine

    model = from_dict(ModelConfig, model_dict)
    layout = ParallelConfig()
    torch.manual_seed(0)
    parallel.initialize(model, layout)
    policy = builder.build_policy_and_reference(model, layout).policy
    sampling = from_dict(SamplingConfig, sampling_dict)
    shared, copied = LocalEngine(model, layout, share_policy_weights=True), LocalEngine(model, layout)
    for engine in (shared, copied):
        engine.update_weights(policy, version=1)
    params = dict(unwrap(policy[0]).named_parameters())
    out = {
        "same_storage": all(p.data_ptr() == params[n].data_ptr() for n, p in shared.model.named_parameters()),
        "copy_storage": any(p.data_ptr() == params[n].data_ptr() for n, p in copied.model.named_parameters()),
    }

    def generate(engine):
        return [c.response_ids for c in engine.generate(prompts, sampling, seed=3)]

    out["before"] = (generate(shared), generate(copied))
    with torch.no_grad():  # an optimizer step: in place
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p.device) * 0.5)
    out["after_step"] = (generate(shared), generate(copied))
    copied.update_weights(policy, version=2)
    out["after_sync"] = (generate(shared), generate(copied))
    name = next(iter(params))
    params[name].data = params[name].data.clone()  # a load that replaces a tensor
    shared.update_weights(policy, version=3)
    out["followed"] = dict(shared.model.named_parameters())[name].data_ptr() == params[name].data_ptr()
    return out


def ragged_engine_worker(rank, world, model_dict: dict, tp: int, prompts, sampling_dict: dict):
    """Ragged prompts through the engine in one batch, counting model forwards; and every prompt alone."""
    from megatron_kl.config import ModelConfig, ParallelConfig
    from megatron_kl.models import builder, parallel
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.local import LocalEngine

    model = from_dict(ModelConfig, model_dict)
    layout = ParallelConfig(tensor_parallel=tp)
    torch.manual_seed(0)
    parallel.initialize(model, layout)
    policy = builder.build_policy_and_reference(model, layout).policy
    sampling = from_dict(SamplingConfig, sampling_dict)
    engine = LocalEngine(model, layout)
    engine.update_weights(policy, version=1)
    forwards = []
    hook = engine.model.register_forward_pre_hook(lambda module, args: forwards.append(tuple(args[0].shape)))
    together = engine.generate(prompts, sampling, seed=4)
    hook.remove()
    alone = [engine.generate([p], sampling, seed=4)[0] for p in prompts]
    forcing = LocalEngine(model, layout, ragged_decoding=False)  # prompt tokens forced, flash kernels
    forcing.update_weights(policy, version=1)
    return {
        "together": together,
        "alone": alone,
        "forwards": forwards,
        "forcing": forcing.generate(prompts, sampling, seed=4),
    }


def failing_train_worker(rank, world, cfg_dict: dict, fail_at: int, kind: str):
    """``train`` with an error injected at RL step ``fail_at`` (``kind``: unexpected - a RuntimeError before the
    step; nonfinite - the NaN/inf abort every rank raises; after_update - a RuntimeError once the step has applied
    an optimizer update); returns the error's message and the checkpoints written."""
    from pathlib import Path

    from megatron_kl.run.preemption import TrainingFailed
    from megatron_kl.train import loop, trainer
    from megatron_kl.train.step import NonFiniteUpdates

    real_step = trainer.rl_step

    def injected(ctx, batch, step):
        if step == fail_at:
            if kind == "nonfinite":
                raise NonFiniteUpdates(f"step {step}: injected")
            if kind == "after_update":
                ctx.counters.optimizer_steps += 1
            raise RuntimeError(f"step {step}: injected")
        return real_step(ctx, batch, step)

    trainer.rl_step = injected  # the name the Trainer calls
    cfg = from_dict(TrainConfig, cfg_dict)
    try:
        loop.train(cfg)
    except TrainingFailed as err:
        checkpoints = sorted(p.name for p in (Path(cfg.train.output_dir) / "checkpoints").glob("step_*"))
        return {
            "error": str(err),
            "cause": type(err.__cause__).__name__,
            "step": err.step,
            "checkpoint": str(err.checkpoint) if err.checkpoint else None,
            "checkpoints": checkpoints,
        }
    return {"error": None}


@contextlib.contextmanager
def started_trainer(cfg_dict: dict):
    """The Trainer of a fresh start of ``cfg_dict`` on this rank (process groups made, stop signals installed) and
    the prepared start; everything is shut down when the block ends."""
    from megatron_kl.models import parallel
    from megatron_kl.run.preemption import StopSignals
    from megatron_kl.train.loop import prepare, seed_everything
    from megatron_kl.train.topology import Topology
    from megatron_kl.train.trainer import Trainer

    cfg = from_dict(TrainConfig, cfg_dict)
    seed_everything(cfg.train.seed)
    prepared = prepare(cfg)
    cfg = prepared.config
    parallel.initialize(cfg.model, cfg.parallel, seed=cfg.train.seed)
    stop = StopSignals(cfg.train.stop_signals)
    try:
        with Trainer(
            cfg, prepared.plan, prepared.task, prepared.hf_source, Topology.from_parallel_state(), stop
        ) as trainer:
            yield trainer, prepared
    finally:
        stop.close()


def trainer_steps_worker(rank, world, cfg_dict: dict, steps: int):
    """One RL step at a time through the Trainer object, without fit(): its metrics per step."""
    with started_trainer(cfg_dict) as (trainer, _):
        records = []
        for step in range(steps):
            result = trainer.step(step)
            assert (result.step, result.engine_version) == (step, step + 1)
            records.append({"step": step, **result.metrics})
        rl_steps = trainer.counters.rl_steps
    return {"records": records, "rl_steps": rl_steps}


def partial_engine_worker(rank, world, model_dict: dict, tp: int, prompts, sampling_dict: dict, pause_at: int):
    """Generate with weights A (version 1), paused after ``pause_at`` token steps, then resumed with weights B (version
    2); return the resumed completions and the trainer's log-probs of them under A and under B."""
    from megatron_kl.models import pipeline
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.local import LocalEngine
    from megatron_kl.train.batching import pack
    from megatron_kl.train.rollouts import _Generated, _resume

    model, layout, models, load = _seeded_policy(model_dict, tp)
    sampling = from_dict(SamplingConfig, sampling_dict)
    engine = LocalEngine(model, layout, interruptible=True)
    boundaries = {"seen": 0}
    agreed = engine._pause_agreed

    def pause_at_boundary():  # the trainer's pause, arriving at a chosen token boundary on every rank
        boundaries["seen"] += 1
        if boundaries["seen"] == pause_at:
            engine.pause()
        return agreed()

    engine._pause_agreed = pause_at_boundary
    load(5)
    engine.update_weights(models.policy, version=1)
    first = engine.generate(prompts, sampling, seed=11)
    engine._pause_agreed = agreed
    load(6)
    engine.update_weights(models.policy, version=2)
    engine.resume()
    done = _resume(engine, _Generated(0, [], prompts, first, 0.0, seed=11), sampling)
    tokens, mask, _ = pack(prompts, [c.response_ids for c in done.completions], 0)
    vocab = pipeline.VocabOptions(model.vocab_size, sampling.logprob_temperature)
    logprobs = {}
    for version, seed in ((2, 6), (1, 5)):
        load(seed)
        logprobs[version] = pipeline.compute_token_stats(
            models.policy, pipeline.SequenceBatch(tokens, mask), 1, vocab
        ).logprobs
    return {"first": first, "done": done.completions, "mask": mask, "logprobs": logprobs}


def fp8_engine_worker(rank, world, model_dict: dict, tp: int, prompts, sampling_dict: dict):
    """An FP8 engine (rollout.quantization=fp8) and the trainer: the engine's behaviour log-probs against the trainer's
    recomputation with the policy's own weights and with them quantized block-wise (rollout/quantization.py)."""
    from megatron_kl.models import pipeline
    from megatron_kl.rollout.engine import SamplingConfig
    from megatron_kl.rollout.local import LocalEngine
    from megatron_kl.rollout.quantization import quantize_model_
    from megatron_kl.train.batching import pack

    model, layout, models, load = _seeded_policy(model_dict, tp)
    load(5)
    sampling = from_dict(SamplingConfig, sampling_dict)
    engine = LocalEngine(model, layout, share_policy_weights=True, quantization="fp8")
    engine.update_weights(models.policy, version=3)
    completions = engine.generate(prompts, sampling, seed=11)
    tokens, mask, behavior = pack(
        prompts, [c.response_ids for c in completions], 0, per_token=[c.response_logprobs for c in completions]
    )
    vocab = pipeline.VocabOptions(model.vocab_size, sampling.logprob_temperature)
    batch = pipeline.SequenceBatch(tokens, mask)
    own = pipeline.compute_token_stats(models.policy, batch, 1, vocab).logprobs
    shared = [p.data_ptr() for p in models.policy[0].parameters()]
    engine_ptrs = {p.data_ptr() for p in engine.model.parameters()}
    quantize_model_(models.policy[0])
    quantized = pipeline.compute_token_stats(models.policy, batch, 1, vocab).logprobs
    return {
        "behavior": behavior,
        "mask": mask,
        "own": own,
        "quantized": quantized,
        "shares_memory": any(ptr in engine_ptrs for ptr in shared),
    }


def delta_engine_worker(rank, world, model_dict: dict, tp: int):
    """The embedded engine with rollout.delta_sync: a full first sync, then deltas after optimizer-like changes; every
    replica tensor against the policy's (bit for bit) and the stats; before the 4th sync a replica element drifts."""
    from megatron_kl.config import ModelConfig, ParallelConfig
    from megatron_kl.models import builder, parallel
    from megatron_kl.rollout.delta import tensor_checksum
    from megatron_kl.rollout.local import LocalEngine

    model = from_dict(ModelConfig, model_dict)
    layout = ParallelConfig(tensor_parallel=tp)
    torch.manual_seed(0)
    parallel.initialize(model, layout)
    policy = builder.build_policy_and_reference(model, layout).policy
    engine = LocalEngine(model, layout, delta_sync=True, delta_check_interval=3)
    generator = torch.Generator().manual_seed(rank)

    def identical():
        mine = dict(engine.model.named_parameters())
        return all(tensor_checksum(mine[n]) == tensor_checksum(p) for n, p in policy[0].named_parameters())

    out = {"stats": [], "identical": []}
    for version in range(1, 6):
        if version > 1:
            with torch.no_grad():
                for i, param in enumerate(policy[0].parameters()):
                    if i % 3 == version % 3:
                        moved = torch.rand(param.shape, generator=generator) < 0.02
                        param.add_(moved * 1e-2)
        if version == 4:  # a replica element changed behind the trainer's back
            with torch.no_grad():
                next(iter(engine.model.parameters())).view(-1)[0] += 1.0
        engine.update_weights(policy, version)
        out["stats"].append(engine.last_sync)
        out["identical"].append(identical())
    return out
