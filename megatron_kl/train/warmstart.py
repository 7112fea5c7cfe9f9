"""Supervised warm start: a few hundred steps of next-token loss on the task's reference answers.

The result is a full (layout-independent) state dict cached on disk under a key derived from the model,
task and warm-start configs and the seed, so repeated runs, TP/PP layouts and the estimator sweep all
start from the same weights; the RL run uses it for the policy and the reference alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_kl.config import ConfigError, ModelConfig, to_dict
from megatron_kl.models import builder, optim, output_head, parallel, pipeline, state
from megatron_kl.run.manifest import sha256_of
from megatron_kl.train import shipped_warmstart
from megatron_kl.train.batching import pack

log = logging.getLogger(__name__)


# implementation choices of the same computation (equal to float32 rounding, tested): not part of the key
# and how the weights are obtained; the seed enters resolved (warm_start.seed null = train.seed: one key)
NOT_IN_KEY = {
    "model": ("logprob_path", "logprob_chunk_rows", "fused_grad"),
    "warm_start": ("cache_dir", "enabled", "source", "seed"),
}


# model fields added after the first shipped warm start: left out of the key at their defaults (the behaviour the
# weights were made with before they existed), so the keys of models that do not use them stay what they were
LATER_MODEL_FIELDS = (
    "yarn",
    "mla",
    "attention_sinks",
    "sliding_window",
    "full_attention_every",
    "linear_bias",
    "glu_activation",
    "glu_up_offset",
    "glu_clamp",
)
LATER_MOE_FIELDS = (
    "shared_expert_gate",
    "score_function",
    "expert_bias",
    "num_groups",
    "group_topk",
    "routed_scaling_factor",
    "first_dense_layers",
)


def _model_key(model) -> dict:
    default = ModelConfig()
    out = {k: v for k, v in to_dict(model).items() if k not in NOT_IN_KEY["model"]}
    for name in LATER_MODEL_FIELDS:
        if getattr(model, name) == getattr(default, name):
            out.pop(name)
    for name in LATER_MOE_FIELDS:
        if getattr(model.moe, name) == getattr(default.moe, name):
            out["moe"].pop(name)
    return out


def warm_start_seed(cfg) -> int:
    return cfg.train.seed if cfg.warm_start.seed is None else cfg.warm_start.seed


def recipe_key(cfg) -> str:
    """16 hex digits of the SHA-256 of what determines the warm start's weights (model, task, recipe, seed)."""
    recipe = {k: v for k, v in to_dict(cfg.warm_start).items() if k not in NOT_IN_KEY["warm_start"]}
    model = _model_key(cfg.model)
    key = json.dumps(
        {
            "model": model,
            "task": _task_key(cfg.task),
            "warm_start": recipe,
            "seed": warm_start_seed(cfg),
            "micro_batches": cfg.train.micro_batches,
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _task_key(task) -> dict:
    """The task section as the key holds it: the dataset task's section (with its files' digests: the answers are the
    warm start's targets) only for that task, so the keys of the other tasks stay what they were before it existed."""
    out = to_dict(task)
    if not out.get("options"):  # a later field (an outside task's settings): out of the key when unused
        out.pop("options", None)
    dataset = out.pop("dataset")
    if task.name == "dataset":
        files = [*task.dataset.train_files]
        out["dataset"] = {**dataset, "digests": [sha256_of(Path(f)) if Path(f).is_file() else f for f in files]}
    return out


def cache_path(cfg) -> Path:
    return Path(cfg.warm_start.cache_dir) / f"warmstart-{recipe_key(cfg)}.pt"


def shipped_entry(cfg) -> Optional[shipped_warmstart.ShippedWarmStart]:
    """This recipe's shipped warm start per ``warm_start.source`` (None: it trains one, and the log says why);
    checked at ``--check`` too: a damaged manifest, or ``shipped`` without one, is named before anything starts."""
    if cfg.warm_start.source == "train" or not cfg.warm_start.enabled or cfg.warm_start.checkpoint:
        return None
    key = recipe_key(cfg)
    directory = shipped_warmstart.SHIPPED_DIR
    where = directory / shipped_warmstart.MANIFEST
    if not shipped_warmstart.manifest_present(directory):
        if cfg.warm_start.source == "shipped":
            raise ConfigError(
                f"warm_start.source=shipped: the package's warm-start manifest {where} is missing; "
                "reinstall the package, or set warm_start.source=auto to train one"
            )
        log.warning(
            "the package's shipped warm starts are missing (%s): training this recipe's warm start, which "
            "float32 rounding makes machine-dependent; reinstall the package to start from the shipped ones",
            where,
        )
        return None
    try:
        entry = shipped_warmstart.find(key, directory)
    except shipped_warmstart.ShippedWarmStartError as err:
        raise ConfigError(str(err)) from None
    if entry is None and cfg.warm_start.source == "shipped":
        known = ", ".join(e.made_with for e in shipped_warmstart.read_manifest(directory).values()) or "none"
        raise ConfigError(
            f"warm_start.source=shipped: the package ships no warm start for this recipe (key {key}; "
            f"shipped: {known}); set warm_start.source=auto to train one"
        )
    return entry


def shipped_state(cfg) -> dict[str, torch.Tensor] | None:
    """The package's warm start for this recipe (verified), per ``warm_start.source``; None: train one."""
    entry = shipped_entry(cfg)
    if entry is None:
        return None
    state_dict = shipped_warmstart.load(entry)
    log.info(
        "warm start: shipped %s (made with %s; file and weights SHA-256 verified, weights %s)",
        entry.path.name,
        entry.made_with,
        entry.weights_sha256[:16],
    )
    return state_dict


def _sft_batch(task, step: int, batch_size: int) -> pipeline.SequenceBatch:
    """Reference completions of training problems far past any RL step's cursor."""
    problems = [task.problem("train", 10_000_000 + step * batch_size + i) for i in range(batch_size)]
    tokens, mask, _ = pack(
        [p.prompt_ids for p in problems], [task.target_ids(p) for p in problems], task.tokenizer.pad_id
    )
    return pipeline.SequenceBatch(tokens, mask)


class WarmStartStopped(RuntimeError):
    """A stop signal ended the warm start at a step boundary (every rank agreed); nothing was cached or trained."""


def _train(cfg, task, should_stop=None) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    ws = cfg.warm_start
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    if ws.batch_size % (dp * cfg.train.micro_batches):
        raise ConfigError(
            f"warm_start.batch_size={ws.batch_size} must be divisible by data-parallel size x "
            f"train.micro_batches = {dp} x {cfg.train.micro_batches}"
        )
    chunks = builder.build_model_chunks(cfg.model, cfg.parallel)
    train_state = optim.build_train_state(
        chunks,
        optim.OptimConfig(  # a run shorter than the warmup decays over one step past it (as the scheduler would)
            lr=ws.lr,
            clip_grad=1.0,
            warmup_steps=10,
            decay_steps=max(ws.steps, 11),
            lr_decay_style="cosine",
            min_lr=ws.lr * 0.1,
        ),
    )
    vocab = pipeline.VocabOptions.for_model(cfg.model, cfg.parallel)
    per_rank = ws.batch_size // dp

    def loss_fn(stats, mb):
        mask = mb.loss_mask.to(stats.logprobs.dtype)
        loss = -(stats.logprobs * mask).sum() / per_rank
        return loss, {"nll": loss.detach(), "tokens": mask.sum()}

    for step in range(ws.steps):
        signal_name = should_stop() if should_stop is not None else None  # collective: every rank, every step
        if signal_name:
            raise WarmStartStopped(f"received {signal_name} at warm-start step {step}/{ws.steps}")
        batch = _sft_batch(task, step, ws.batch_size)
        local = batch.select(torch.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        out = optim.train_step(train_state, local, cfg.train.micro_batches, loss_fn, vocab)
        if step % 50 == 0 or step == ws.steps - 1:
            nll = sum(float(m["nll"]) for m in out.microbatch_metrics)
            log.info("warm start step %d/%d: nll/sequence %.4f", step + 1, ws.steps, nll)
    tied = cfg.model.tie_word_embeddings
    full = state.full_state_dict(
        [output_head.unwrap(c) for c in train_state.chunks],
        cfg.model.vocab_size,
        tied,
        parallel.tp_group(),
        parallel.pp_group(),
    )
    return full


def warm_start_state(cfg, task, should_stop=None) -> dict[str, torch.Tensor] | None:
    """The full state to initialise policy and reference with (None: keep the random init). ``should_stop()``:
    the stop signal the ranks agree on (or None), asked before every warm-start step."""
    ws = cfg.warm_start
    if ws.checkpoint:
        path = Path(ws.checkpoint)
        if not path.is_file():
            raise FileNotFoundError(f"warm_start.checkpoint={ws.checkpoint} does not exist")
        return torch.load(path, map_location="cpu", weights_only=True)
    if not ws.enabled:
        return None
    shipped = shipped_state(cfg)
    if shipped is not None:
        return shipped
    path = cache_path(cfg)
    if path.is_file():
        cached = _load_verified(path)
        if cached is not None:
            log.info("warm start: cached %s (SHA-256 verified)", path)
            return cached
    log.info("warm start: %d supervised steps, seed %d (cache miss: %s)", ws.steps, warm_start_seed(cfg), path)
    parallel.reseed(warm_start_seed(cfg))
    full = _train(cfg, task, should_stop)
    parallel.reseed(cfg.train.seed)  # the RL phase draws the same numbers on a cache hit and a miss
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(full, tmp)
        digest_tmp = digest_path(path).with_suffix(f".tmp{os.getpid()}")
        digest_tmp.write_text(f"{sha256_of(tmp)}  {path.name}\n")
        os.replace(tmp, path)  # atomic: a killed run never leaves a truncated cache
        os.replace(digest_tmp, digest_path(path))  # a kill between the two: digest missing, recomputed next time
    dist.barrier()
    return full


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _load_verified(path: Path):
    """The cached warm start if its bytes match the SHA-256 written with it; None (and a warning saying why: the
    policy and the KL reference of every run sharing the cache start from it) to recompute it."""
    recorded = digest_path(path)
    if not recorded.is_file():
        log.warning("warm start: cache %s has no digest beside it (%s): recomputing it", path, recorded.name)
        return None
    expected = (recorded.read_text().split() or [""])[0]
    actual = sha256_of(path)
    if actual != expected:
        log.warning(
            "warm start: cache %s does not match its SHA-256 (%s, recorded %s): the file is damaged; recomputing it",
            path,
            actual[:16],
            expected[:16],
        )
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
