"""The trainer's rules between config sections: what no section can check alone (a section's own bounds, choices and
rules are on its dataclass; an engine's on its spec in rollout/builtin_engines.py; distillation's in
distill/checks.py). ``cfg`` is a TrainConfig (megatron_kl.train.config builds it and calls :func:`check_sections`).

Every rule raises ConfigError naming the fields and the fix.
"""

from __future__ import annotations

from megatron_kl.algo.config import row_separable
from megatron_kl.config import ConfigError, from_dict
from megatron_kl.distill.checks import check_distillation
from megatron_kl.rollout.registry import ENGINES


def check_sections(cfg) -> None:
    """The rules between sections that need nothing but the config (checked when a TrainConfig is built, after each
    section's own): where the run starts, the positions a response may take, the verifier service, distillation."""
    if cfg.init.hf_checkpoint is not None and cfg.warm_start.source == "shipped":
        raise ConfigError(
            f"warm_start.source=shipped with init.hf_checkpoint={cfg.init.hf_checkpoint}: a run that "
            "starts from an HF checkpoint has no warm start; drop one of the two"
        )
    if cfg.init.hf_checkpoint is None:  # an HF checkpoint brings its own positions (checked when it is read)
        positions = cfg.model.max_position_embeddings
        for name, tokens in (
            ("rollout.sampling.max_new_tokens", cfg.rollout.sampling.max_new_tokens),
            ("eval.max_new_tokens", cfg.eval.max_new_tokens),
        ):
            if tokens is not None and tokens >= positions:
                raise ConfigError(
                    f"{name}={tokens} leaves no position for the prompt: model.max_position_embeddings="
                    f"{positions} holds prompt + response; lower {name} or raise the positions"
                )
    if (
        any(f.name == "service" for f in cfg.reward.functions)
        and not cfg.reward.service.urls
        and cfg.launch.reward_service.mode == "none"
    ):
        raise ConfigError(
            "reward.functions names 'service' but reward.service.urls is empty: give the verifier's "
            "address, e.g. reward.service.urls=[http://verifier:8000] (or start it with the job: "
            "launch.reward_service.mode=heterogeneous)"
        )
    check_distillation(cfg)


def distill_verdict(cfg):
    """The audit's verdict on the distillation term for distill.kl.target in the run's regime (the same audit as the
    reference term's: the teacher is the other distribution); None without distillation."""
    from megatron_kl.kl.audit.targets import judge, regime_of
    from megatron_kl.kl.corrections import correction_of

    objective = cfg.distill.objective()
    if objective is None:
        return None
    return judge(objective, regime_of(objective, cfg.train.staleness), correction_of(cfg.algo))


def kl_verdict(cfg):
    """The audit's verdict (megatron_kl.kl.audit.targets.Verdict) on the run's KL term for kl.target in its regime;
    None without a KL term (kl.coef=0, or RPG's own KL)."""
    from megatron_kl.kl.audit.targets import judge, regime_of
    from megatron_kl.kl.corrections import correction_of

    if cfg.kl.coef == 0 or cfg.algo.loss == "rpg":
        return None
    return judge(cfg.kl, regime_of(cfg.kl, cfg.train.staleness), correction_of(cfg.algo))


def _check_kl_target(cfg) -> None:
    if (
        cfg.kl.off_policy == "behavior"
        and cfg.kl.coef > 0
        and (cfg.algo.loss != "ppo" or cfg.algo.behavior_correction == "none")
    ):
        raise ConfigError(
            "kl.off_policy=behavior weights the KL term with algo.behavior_correction's weights: set "
            "algo.behavior_correction (with algo.loss=ppo) or choose another kl.off_policy"
        )
    sampling = cfg.rollout.sampling
    if (
        cfg.kl.target == "token_forward"
        and cfg.kl.coef > 0
        and sampling.distribution == "truncated"
        and sampling.truncates(cfg.model.vocab_size)
    ):
        raise ConfigError(
            "kl.target=token_forward with top_k/top_p truncation: KL(pi_ref || mu) is infinite (the "
            "reference has mass outside the truncated policy's support; megatron-kl audit --top-k/--top-p);"
            " declare kl.target=token_reverse or sequence_reverse"
        )
    if cfg.kl.strict and sampling.distribution == "full" and sampling.truncates(cfg.model.vocab_size):
        raise ConfigError(
            "kl.strict=true with rollout.sampling.distribution=full and top_k/top_p truncation: the "
            "samples come from the truncated distribution, the gradient is the full softmax's (biased); "
            "set rollout.sampling.distribution=truncated"
        )
    if cfg.kl.strict:
        verdict = kl_verdict(cfg)
        if verdict is not None and not verdict.unbiased:
            raise ConfigError(
                f"kl.strict=true: {verdict.describe()} (exact audit, docs/kl-math.md). Set "
                "kl.estimator=auto to use an unbiased configuration, change kl.target, or kl.strict=false"
            )


def validate_train_config(cfg, tokenizer_vocab: int, data_parallel: int = 1) -> None:
    """The rules that need the run's world (the tokenizer, the data-parallel size) or the engine's spec, before any
    process group or model exists; each section's own rules ran when it was built, :func:`check_sections` too."""
    engine = _check_engine(cfg)
    _check_start(cfg)
    _check_batch(cfg, tokenizer_vocab, data_parallel)
    _check_algorithm(cfg)
    _check_partial_rollouts(cfg, engine)
    _check_kl_target(cfg)
    _check_timeouts(cfg, engine)


def _check_start(cfg) -> None:
    """The supervised warm start runs on whole sequences."""
    cp = cfg.parallel.context_parallel
    if cp > 1 and cfg.warm_start.enabled and not cfg.warm_start.checkpoint and cfg.init.hf_checkpoint is None:
        raise ConfigError(
            f"warm_start (the supervised phase) does not split its sequences under "
            f"parallel.context_parallel={cp}; start from init.hf_checkpoint or warm_start.checkpoint, or "
            "set warm_start.enabled=false"
        )


def _check_batch(cfg, tokenizer_vocab: int, data_parallel: int) -> None:
    """The vocabulary holds the tokenizer's; a step's samples split evenly over data-parallel ranks, minibatches and
    micro-batches."""
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the task tokenizer's {tokenizer_vocab}: "
            f"set model.vocab_size >= {tokenizer_vocab}"
        )
    run = cfg.train
    per_rank, rest = divmod(run.prompts_per_step * run.group_size, data_parallel)
    if rest or run.prompts_per_step % data_parallel:
        raise ConfigError(
            f"train.prompts_per_step={run.prompts_per_step} must be divisible by the data-parallel size {data_parallel}"
        )
    if per_rank % (cfg.algo.minibatches * run.micro_batches):
        raise ConfigError(
            f"samples per rank per step ({per_rank} = prompts_per_step x group_size / DP) must be divisible by "
            f"algo.minibatches x train.micro_batches = {cfg.algo.minibatches} x {run.micro_batches}"
        )


def _check_algorithm(cfg) -> None:
    """The policy gradient is not zero by construction, RPG's KL is not added twice, group baselines have groups,
    the gradient computed in the forward pass has a loss that allows it."""
    if cfg.rollout.sampling.temperature == 0:
        raise ConfigError(
            "rollout.sampling.temperature=0 samples greedily: every sample of a group is the same "
            "answer, every advantage is 0 and the policy gradient is exactly 0 (nothing trains); set "
            "rollout.sampling.temperature > 0 (e.g. 1.0; greedy evaluation is eval's pass@1)"
        )
    if cfg.algo.loss == "rpg" and cfg.kl.coef > 0:
        raise ConfigError(
            "algo.loss=rpg carries its own KL (algo.rpg.coef); set kl.coef=0 to avoid adding a second KL term"
        )
    if cfg.algo.advantage in ("grpo", "rloo", "reinforce_pp_baseline") and cfg.train.group_size < 2:
        raise ConfigError(f"algo.advantage={cfg.algo.advantage} needs train.group_size >= 2")
    if cfg.model.fused_grad == "in_forward" and not row_separable(cfg.kl, cfg.algo):
        raise ConfigError(
            "model.fused_grad=in_forward needs a row-separable loss (PPO or RPG with the KL in the "
            "reward or a token-level KL in the loss, no per-decision weights, algo.ratio_level=token, "
            "algo.old_logprobs=recompute); use auto or recompute"
        )


def _check_engine(cfg):
    """The rules every engine's flags decide (training layout, routing replay), then the engine's own rules."""
    spec = ENGINES.get(cfg.rollout.engine, "rollout.engine")
    name = spec.name
    pp, cp = cfg.parallel.pipeline_parallel, cfg.parallel.context_parallel
    if pp > 1 and not spec.pipeline_parallel:
        raise ConfigError(
            f"rollout.engine={name} supports parallel.pipeline_parallel=1 only (got {pp}); use "
            f"rollout.engine in {ENGINES.where(lambda e: e.pipeline_parallel)} with pipeline parallelism"
        )
    if cp > 1 and not spec.context_parallel:
        raise ConfigError(
            f"rollout.engine={name} generates with the training layout, which holds a shard of each "
            f"sequence under parallel.context_parallel={cp}; use rollout.engine in "
            f"{ENGINES.where(lambda e: e.context_parallel)}"
        )
    if cfg.model.moe.routing_replay == "rollout" and not spec.reports_routing:
        raise ConfigError(
            f"model.moe.routing_replay=rollout with rollout.engine={name}: that engine does not report "
            f"the experts it routed each token to; use rollout.engine in {ENGINES.where(lambda e: e.reports_routing)} "
            "or set model.moe.routing_replay=off"
        )
    if cfg.rollout.options and spec.options is None:
        raise ConfigError(
            f"rollout.options={dict(cfg.rollout.options)!r}: rollout.engine={name} takes its settings "
            f"from {spec.section or 'no section'}, not rollout.options; remove rollout.options"
        )
    if spec.options is not None:  # read as the builder will, so a bad option is reported now
        from_dict(spec.options, dict(cfg.rollout.options), prefix="rollout.options.")
    for rule in spec.checks:
        rule(cfg)
    return spec


def _check_timeouts(cfg, engine) -> None:
    """A served engine's worst case - every attempt of a request at its deadline plus the backoffs, or a
    server start - must end before the other ranks' collective times out, so a dead server is reported by
    the HTTP client, not by a collective timeout elsewhere."""
    from megatron_kl.rollout.http import RetryPolicy  # requests: not loaded where a config is only read

    limit = cfg.parallel.distributed_timeout_s
    if engine.limits is None:
        return
    served = engine.limits(cfg)
    budget = RetryPolicy(served.max_retries, served.backoff_s, served.request_timeout_s).budget_s
    if budget >= limit:
        raise ConfigError(
            f"{served.section}: a request can take {budget:.0f}s ((max_retries={served.max_retries} + 1) x "
            f"request_timeout_s={served.request_timeout_s:g} + backoff), not less than parallel.distributed_timeout_s="
            f"{limit:g}: lower {served.section}.request_timeout_s / max_retries or raise the distributed timeout"
        )
    startup = served.startup_timeout_s
    if startup is not None and startup >= limit:
        raise ConfigError(
            f"{served.section}.startup_timeout_s={startup:g} must be below parallel.distributed_timeout_s="
            f"{limit:g} (the other ranks wait for the servers in a barrier)"
        )


def _check_partial_rollouts(cfg, engine) -> None:
    """rollout.partial needs generations that overlap a weight update (train.staleness > 0) and an engine that can
    pause them mid-response."""
    if not cfg.rollout.partial:
        return
    if cfg.train.staleness == 0:
        raise ConfigError(
            "rollout.partial=true resumes generations across weight updates, but train.staleness=0 "
            "generates each batch with the current weights (none is in flight at an update): set "
            "train.staleness >= 1 or rollout.partial=false"
        )
    if not engine.can_pause(cfg):
        raise ConfigError(
            f"rollout.partial=true with rollout.engine={engine.name}"
            + (f" and rollout.vllm.mode={cfg.rollout.vllm.mode}" if engine.name == "vllm" else "")
            + ": that engine cannot pause a generation and return its partial response; use "
            f"rollout.engine in {ENGINES.where(lambda e: e.can_pause(cfg))}"
            + (" or rollout.vllm.mode=server" if engine.name == "vllm" else "")
            + ", or rollout.partial=false"
        )
