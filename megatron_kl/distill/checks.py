"""The distillation section's rules against the rest of a run's configuration (``distill.*`` with ``kl.*``, the
sampler, the layout), checked where every configuration is validated (megatron_kl.train.config); ``cfg`` is a
TrainConfig."""

from __future__ import annotations

from megatron_kl.config import ConfigError
from megatron_kl.kl.config import AUTO, TOP_K


def check_distillation(cfg) -> None:
    """distill.* against the rest: the KL to the reference a served teacher allows, what is left to train, the top-k
    term's and the served teacher's limits, the behaviour weights."""
    if not cfg.distill.enabled:
        return
    objective = cfg.distill.kl
    if cfg.kl.exact and cfg.kl.coef > 0 and cfg.distill.teacher.source == "server":
        raise ConfigError(
            "kl.estimator=full with distill.teacher.source=server: the exact KL to the reference is taken "
            "beside a loaded teacher's only; estimate the KL to the reference from the sampled token "
            "(kl.estimator=k1/k2/k3), load the teacher (source=hf), or set kl.coef=0"
        )
    if objective.coef == 0 and cfg.distill.task_reward == "none":
        raise ConfigError(
            "distill.kl.coef=0 with distill.task_reward=none leaves nothing to train: give the "
            "distillation term a weight (distill.kl.coef > 0) or keep the task reward"
        )
    if objective.estimator == AUTO and objective.coef == 0:
        return
    if objective.estimator == TOP_K:
        _check_top_k(cfg)
    if cfg.distill.teacher.source == "server":
        _check_served_teacher(cfg)
    if objective.off_policy == "behavior" and (cfg.algo.loss != "ppo" or cfg.algo.behavior_correction == "none"):
        raise ConfigError(
            "distill.kl.off_policy=behavior weights the distillation term with "
            "algo.behavior_correction's weights: set algo.behavior_correction (with algo.loss=ppo) or "
            "choose another distill.kl.off_policy"
        )


def _check_top_k(cfg) -> None:
    """distill.kl.estimator=topk against the model, the sampler and the layout."""
    objective = cfg.distill.kl
    if objective.top_k >= cfg.model.vocab_size:
        raise ConfigError(
            f"distill.kl.top_k={objective.top_k} covers the whole vocabulary (model.vocab_size="
            f"{cfg.model.vocab_size}): use distill.kl.estimator=full, the exact KL, instead"
        )
    if cfg.rollout.sampling.trained_truncation(cfg.model.vocab_size) is not None:
        raise ConfigError(
            "distill.kl.estimator=topk with a truncated sampling distribution (rollout.sampling.top_k / "
            "top_p, rollout.sampling.distribution=truncated): the student's log-probs at the teacher's "
            "top-k ids are those of the full softmax; use distill.kl.estimator=full (the truncated "
            "policy's exact KL) or train the full distribution"
        )
    if cfg.parallel.context_parallel > 1:
        raise ConfigError(
            f"distill.kl.estimator=topk with parallel.context_parallel={cfg.parallel.context_parallel}: "
            "the teacher's top-k rows are not split over context-parallel ranks; use context_parallel=1 "
            "or distill.kl.estimator=full"
        )


def _check_served_teacher(cfg) -> None:
    """distill.teacher.source=server: log-probs over HTTP, no logits."""
    if cfg.distill.kl.exact:
        raise ConfigError(
            "distill.kl.estimator=full with distill.teacher.source=server: a served teacher gives "
            "log-probs, not its logits, so its exact KL cannot be formed; use distill.kl.estimator=topk "
            "(its top-k, an approximation) or a sampled estimator (k1 in the reward with reward-to-go is "
            "unbiased for the sequence-level KL), or load the teacher (source=hf)"
        )
    if cfg.rollout.sampling.logprob_temperature != 1.0:
        raise ConfigError(
            f"distill.teacher.source=server with rollout.sampling.temperature="
            f"{cfg.rollout.sampling.temperature}: the servers score softmax(z) at temperature 1, the "
            "student's log-probs are at the sampling temperature; sample at temperature 1 or load the "
            "teacher (source=hf)"
        )
