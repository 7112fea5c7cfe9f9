"""The exact audit of on-policy distillation: a tabular student and a tabular teacher.

The distillation term is a KL term whose other distribution is the teacher: KL(pi || pi_teacher) in pi_ref's place.
Its estimators are the KL library's, so the audit of :mod:`megatron_kl.kl.audit.exact` applies as it stands once the
problem's other table is a teacher's. What differs is the regime: a reference starts equal to the policy, a teacher
is far from the student (sharper, disagreeing), so per-token log-ratios are O(1) and the biases of the estimators
are large where a reference run would hide them. :func:`teacher_problem` builds such a teacher; :data:`RECIPES`
names the recipes peers ship and this project's exact one; :func:`recipe_verdicts` says which of them give the
unbiased gradient of the sequence-level reverse KL to the teacher (and of the prefix-frozen token-level one).

With a task reward and the KL to the reference beside it, the trainer's gradient is the sum of the three terms'
estimators; expectations add, so the combined gradient is unbiased for E_pi[R] - beta_ref KL(pi || pi_ref) -
beta_teacher KL(pi || pi_teacher) exactly when each KL term is unbiased for its sequence-level KL
(:func:`combined_bias` checks that sum on the tables).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_kl.kl.audit.exact import AuditRow, TabularProblem, _estimator_gradients, audit, exact_targets
from megatron_kl.kl.config import UNBIASED_TOL, TopKConfig
from megatron_kl.kl.objective import KLConfig

# recipe name -> the distillation term's configuration (distill.kl.*)
RECIPES = {
    "exact reverse KL in the loss, sequence level (this project's default)": KLConfig(
        estimator="full", placement="loss", level="sequence", coef=0.1
    ),
    "exact reverse KL per token in the loss": KLConfig(estimator="full", placement="loss", level="token", coef=0.1),
    "sampled k1 per token as its own reward (the common recipe)": KLConfig(
        estimator="k1", placement="reward", level="token", credit="immediate", coef=0.1
    ),
    "sampled k1 per token in the reward, reward-to-go": KLConfig(
        estimator="k1", placement="reward", level="token", credit="reward_to_go", coef=0.1
    ),
    "sampled k3 per token in the loss": KLConfig(estimator="k3", placement="loss", level="token", coef=0.1),
    "teacher's top-1 of 3, rest as one outcome, sequence level (a served teacher)": TopKConfig(
        estimator="topk", top_k=1, top_k_tail="bucket", placement="loss", level="sequence", coef=0.1
    ),
    "teacher's top-2 of 3, renormalised, sequence level": TopKConfig(
        estimator="topk", top_k=2, top_k_tail="renormalize", placement="loss", level="sequence", coef=0.1
    ),
}


def teacher_problem(vocab: int = 3, length: int = 3, seed: int = 0, sharpness: float = 3.0) -> TabularProblem:
    """A random tabular student (logits ~ N(0, 1)) and a teacher ``sharpness`` times sharper drawn independently:
    the problem's reference table is the teacher's."""
    base = TabularProblem.random(vocab, length, seed)
    g = torch.Generator().manual_seed(20_000 + seed)
    teacher = sharpness * torch.randn(base.reference_table.shape, generator=g, dtype=torch.float64)
    return dataclasses.replace(base, reference_table=teacher)


def recipe_verdicts(problem: TabularProblem, off_policy: bool = False) -> list[tuple[str, AuditRow]]:
    """Each recipe's audit row on ``problem`` (relative bias for the sequence-level and token-level KL to the
    teacher, variance, verdict)."""
    rows = audit(problem, off_policy, list(RECIPES.values()))
    return list(zip(RECIPES, rows))


def combined_bias(
    problem: TabularProblem,
    teacher_table: torch.Tensor,
    rewards: torch.Tensor,
    reference_term: KLConfig,
    teacher_term: KLConfig,
    beta_reference: float,
    beta_teacher: float,
    off_policy: bool = False,
) -> float:
    """Relative bias of the trainer's combined expected gradient (REINFORCE on ``rewards`` [N] per sequence, the
    reference term, the distillation term) against the exact gradient of E_pi[R] - beta_ref KL(pi || pi_ref) -
    beta_teacher KL(pi || pi_teacher); ``problem``'s reference table is the reference, ``teacher_table`` the
    teacher's."""
    teacher = dataclasses.replace(problem, reference_table=teacher_table)
    logp = problem.log_probs(problem.policy_table).gather(-1, problem.sequences[..., None])[..., 0].sum(-1)
    seq_prob = logp.exp()
    reward_grad = torch.autograd.grad((seq_prob * rewards).sum(), problem.policy_table, retain_graph=True)[0]
    target = (
        reward_grad
        - beta_reference * exact_targets(problem, off_policy)["seq"]
        - beta_teacher * exact_targets(teacher, off_policy)["seq"]
    )
    expected = reward_grad.clone()
    for beta, term, source in ((beta_reference, reference_term, problem), (beta_teacher, teacher_term, teacher)):
        grads, q = _estimator_gradients(source, term, off_policy)
        expected -= beta * (q.view(-1, *([1] * (grads.dim() - 1))) * grads).sum(0)
    return float((expected - target).norm() / target.norm())


def format_recipes(verdicts: list[tuple[str, AuditRow]], title: Optional[str] = None) -> str:
    width = max(len(name) for name, _ in verdicts)
    lines = [title] if title else []
    lines.append(
        f"{'recipe':{width}s} {'configuration':32s} {'bias:seq':>10s} {'bias:token':>10s} "
        f"{'bias:fwd':>10s} {'variance':>10s}  unbiased gradient of"
    )
    for name, row in verdicts:
        said = {
            "seq": "the sequence-level reverse KL",
            "token": "the token-level reverse KL only (prefix frozen)",
            "forward": "the token-level forward KL(teacher || pi) only",
        }
        unbiased = [t for t in said if row.rel_bias[t] < UNBIASED_TOL]
        verdict = said[unbiased[0]] if unbiased else "no KL (biased for each)"
        lines.append(
            f"{name:{width}s} {row.name:32s} {row.rel_bias['seq']:10.2e} {row.rel_bias['token']:10.2e} "
            f"{row.rel_bias['forward']:10.2e} {row.variance:10.2e}  {verdict}"
        )
    return "\n".join(lines)
