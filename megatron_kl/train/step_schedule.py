"""Which passes one RL step runs: the reference forward (when a term needs it, else every
``train.reference_metrics_interval`` steps for the kl/* metrics), the exact KL over the vocabulary, and under
distillation the exact KL to the reference beside the teacher's."""

from __future__ import annotations


def needs_reference(cfg, step: int) -> bool:
    """Whether this step runs the reference forward: always when a term uses it (a KL with kl.coef > 0, or
    RPG); otherwise only for the kl/* metrics, every ``train.reference_metrics_interval`` steps."""
    if cfg.kl.coef > 0 or cfg.algo.loss == "rpg":
        return True
    return metrics_due(cfg, step)


def metrics_due(cfg, step: int) -> bool:
    """A step of metric-only reference work (every ``train.reference_metrics_interval`` steps)."""
    return step % cfg.train.reference_metrics_interval == 0


def regularizer_due(cfg, step: int) -> bool:
    """Under distillation, whether this step takes the exact KL to the reference beside the teacher's (a second sweep
    over the vocabulary): kl.estimator=full with a reference pass this step."""
    return (
        cfg.distill.enabled and cfg.distill.teacher.source != "server" and cfg.kl.exact and needs_reference(cfg, step)
    )


def anchor_objective(cfg):
    """The KL term whose other model the exact KL is taken to: distill.kl under distillation, else kl."""
    return cfg.distill.kl if cfg.distill.enabled else cfg.kl


def needs_exact_kl(cfg, step: int) -> bool:
    """Whether this step computes the exact per-position KL over the vocabulary (the other model's output
    projection once more: the reference's, or under distillation the teacher's): always when a term reads it
    (estimator=full with coef > 0); otherwise it only feeds kl/exact_* (distill/exact_*), every
    ``train.reference_metrics_interval`` steps."""
    if cfg.distill.enabled and cfg.distill.teacher.source == "server":  # no teacher logits in the job
        return False
    term = anchor_objective(cfg)
    if term.coef > 0 and term.exact:
        return True
    return metrics_due(cfg, step)
