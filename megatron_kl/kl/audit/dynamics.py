"""Exact training dynamics of every KL configuration on the audit's tabular policy (float64).

The audit (kl/audit/exact.py) says which configurations' expected gradients are biased; this module shows what the
bias does to training. A reward r(y) on whole sequences and the sequence-level objective

    J(pi) = E_pi[r] - beta KL(pi || pi_ref)

have the closed-form optimum pi*(y) = pi_ref(y) exp(r(y) / beta) / Z. Every configuration is trained from
pi = pi_ref by gradient ascent on the policy's logit table with

    d = grad E_pi[r] - beta E_q[g_KL]

where grad E_pi[r] is exact and E_q[g_KL] is the configuration's per-sample KL-gradient estimator g (built through
the public API, as the audit builds it) in exact expectation (q = pi on-policy; q = mu, a fixed behaviour policy,
off-policy). A configuration unbiased for the sequence-level reverse KL follows grad J and reaches pi*; a biased
one reaches another fixed point (e.g. the token-level optimum) or none (k1 in the loss: E[g] = 0, the reward
maximiser, logits grow without bound).

The expectation is one backward pass: every estimator is a sum of independent per-row terms under an equal-weight
aggregation over rows, so scaling the gradient that reaches row y by N q(y) turns the batch gradient of all N
sequences into sum_y q(y) g(y) (checked against the audit's per-sample sum in the tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron_kl.kl.audit.exact import TabularProblem, _quantities, audit, exact_targets, judge
from megatron_kl.kl.corrections import Correction
from megatron_kl.kl.objective import KLConfig, kl_loss, kl_shaped_returns, policy_gradient_surrogate
from megatron_kl.kl.rpg import DIVERGENCES, SURROGATES, RPGConfig, rpg_loss


class _RowScale(torch.autograd.Function):
    """Identity forward; the backward gradient of row i is multiplied by ``scale[i]``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale.view(-1, *([1] * (grad.dim() - 1))), None


def kl_gradient(
    problem: TabularProblem,
    cfg: Union[KLConfig, RPGConfig],
    weights: torch.Tensor,
    off_policy: bool = False,
    correction: Optional[Correction] = None,
) -> torch.Tensor:
    """sum_y weights[y] g(y): the configuration's per-sample estimator of grad KL (divided by ``cfg.coef``),
    weighted per sequence (the exact expectation with weights = q(y); a minibatch average with weights = counts / B).
    A KL configuration with ``off_policy='behavior'`` takes the behaviour ``correction``'s weights on its KL term,
    computed from pi / mu as the trainer computes them; an RPG loss (:class:`RPGConfig`) contributes its KL part
    (its loss at zero advantages, with the sampler as pi_old), summed over tokens."""
    lp, ref_lp, _, full_kl, _, _, recorded = _quantities(problem)
    n = len(lp)
    scale = (weights * n).to(lp.dtype)
    behavior = (recorded if off_policy else lp).detach()
    mask = torch.ones_like(lp, dtype=torch.bool)
    weight = None
    if isinstance(cfg, KLConfig) and cfg.off_policy == "behavior":
        if correction is None:
            raise ValueError(f"{cfg.name}: kl.off_policy=behavior needs the behaviour correction it borrows")
        weight, _ = correction.weights(lp.detach(), behavior, mask)
    lp, full_kl = _RowScale.apply(lp, scale), _RowScale.apply(full_kl, scale)
    if isinstance(cfg, RPGConfig):
        loss, _ = rpg_loss(
            dataclasses.replace(cfg, aggregation="seq_mean_token_sum"), lp, behavior, ref_lp, torch.zeros_like(lp), mask
        )
        estimate = loss / cfg.coef
    elif cfg.placement == "loss":
        estimate = (
            kl_loss(
                cfg,
                lp,
                ref_lp,
                mask,
                behavior_logprobs=behavior,
                behavior_weight=weight,
                full_kl=full_kl if cfg.exact else None,
            )
            / cfg.coef
        )
    else:
        returns = kl_shaped_returns(
            cfg,
            torch.zeros(n, dtype=lp.dtype),
            lp,
            ref_lp,
            mask,
            behavior_logprobs=behavior,
            full_kl=full_kl if cfg.exact else None,
        )
        estimate = policy_gradient_surrogate(
            cfg, lp, -returns / cfg.coef, mask, behavior_logprobs=behavior, behavior_weight=weight
        )
    (grad,) = torch.autograd.grad(estimate, problem.policy_table, allow_unused=True)
    return grad if grad is not None else torch.zeros_like(problem.policy_table)


def rpg_configs(coef: float = 0.1) -> list[RPGConfig]:
    """Every RPG divergence with both surrogates (the differentiable one without clipping, as its config requires)."""
    return [
        RPGConfig(
            divergence=d,
            surrogate=s,
            coef=coef,
            **({"clip_low": None, "clip_high": None, "dual_clip": None} if s == "differentiable" else {}),
        )
        for d in DIVERGENCES
        for s in SURROGATES
    ]


def verdict_of(problem: TabularProblem, cfg, off_policy: bool) -> str:
    """The audit's verdict for any configuration this module trains: the expected gradient against the three KL
    targets (used for the RPG losses, which the audit's table does not list)."""
    table = problem.behavior_table if off_policy else problem.policy_table
    q = sequence_log_probs(problem, table).exp().detach()
    return judge(kl_gradient(problem, cfg, q, off_policy), exact_targets(problem, off_policy))[2]


def sequence_log_probs(problem: TabularProblem, table: torch.Tensor) -> torch.Tensor:
    """log pi(y) of every sequence [N] under the logit table."""
    return problem.log_probs(table).gather(-1, problem.sequences[..., None])[..., 0].sum(-1)


def optimum_log_probs(problem: TabularProblem, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """log pi*(y) = log pi_ref(y) + r(y) / beta - log Z."""
    logits = sequence_log_probs(problem, problem.reference_table) + rewards / beta
    return logits - torch.logsumexp(logits, 0)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    return float((logp.exp() * (logp - logq)).sum())


@dataclass
class Outcome:
    name: str
    steps: int
    converged: bool  # |d| fell below the tolerance
    kl_to_optimum: float  # KL(pi_final || pi*)
    kl_to_reference: float  # KL(pi_final || pi_ref)
    expected_reward: float
    gradient_norm: float  # |d| at the end
    logit_range: float  # max - min of the final logit table (grows without bound when nothing regularises)

    def fixed_point(self, optimum_logit_range: float, tolerance: float = 1e-8) -> str:
        if self.kl_to_optimum < tolerance:
            return "pi* (the regularised optimum)"
        if self.converged:
            return "another fixed point (biased)"
        return f"none within {self.steps} steps (logit range {self.logit_range:.1f}; pi*'s {optimum_logit_range:.1f})"


def reward_gradient(
    problem: TabularProblem, rewards: torch.Tensor, weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """grad E_pi[r] exactly (``weights`` None) or its REINFORCE estimate sum_y weights[y] r(y) grad log pi(y)."""
    logp = sequence_log_probs(problem, problem.policy_table)
    if weights is None:
        objective = (logp.exp() * rewards).sum()
    else:
        objective = (weights * rewards * logp).sum()
    (grad,) = torch.autograd.grad(objective, problem.policy_table)
    return grad


def direction(
    problem: TabularProblem,
    rewards: torch.Tensor,
    beta: float,
    cfg: Optional[KLConfig],
    off_policy: bool = False,
    correction: Optional[Correction] = None,
) -> torch.Tensor:
    """d = grad E_pi[r] - beta E_q[g_KL] at ``problem.policy_table`` (``cfg`` None: the reward's gradient alone)."""
    d = reward_gradient(problem, rewards)
    if cfg is None:
        return d
    table = problem.behavior_table if off_policy else problem.policy_table
    q = sequence_log_probs(problem, table).exp().detach()
    return d - beta * kl_gradient(problem, dataclasses.replace(cfg, coef=beta), q, off_policy, correction)


def train_exact(
    problem: TabularProblem,
    rewards: torch.Tensor,
    beta: float,
    cfg: Optional[KLConfig],
    lr: float = 2.0,
    steps: int = 3000,
    tolerance: float = 1e-10,
    off_policy: bool = False,
    trace: Optional[list] = None,
    correction: Optional[Correction] = None,
) -> Outcome:
    """Gradient ascent on the logit table from pi_ref with the configuration's exact expected direction
    (``cfg`` None: beta = 0, the reward alone). Stops when |d| < tolerance or after ``steps``. ``trace`` (a list)
    receives KL(pi || pi*) after every step."""
    optimum = optimum_log_probs(problem, rewards, beta) if trace is not None else None
    table = problem.reference_table.clone().requires_grad_(True)
    state = dataclasses.replace(problem, policy_table=table)
    norm, step = math.inf, 0
    for step in range(1, steps + 1):  # noqa: B007 - the last step is reported after the loop
        d = direction(state, rewards, beta, cfg, off_policy, correction)
        norm = float(d.norm())
        if not math.isfinite(norm) or norm < tolerance:
            break
        with torch.no_grad():
            table += lr * d
            if trace is not None:
                trace.append(_kl(sequence_log_probs(state, table), optimum))
    return _outcome(row_name(cfg, correction), state, rewards, beta, step, norm < tolerance, norm)


def row_name(cfg, correction: Optional[Correction] = None) -> str:
    """A configuration's row name: its name, with the behaviour correction's label when its KL term borrows one."""
    if cfg is None:
        return "no-kl"
    return cfg.name + (f"[{correction.label}]" if correction is not None else "")


def optimum_table(problem: TabularProblem, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """A logit table whose policy is pi* (every prefix state's next-token distribution, from pi*'s marginals)."""
    logp = optimum_log_probs(problem, rewards, beta)
    table = torch.zeros_like(problem.reference_table)
    for t in range(problem.length):
        for state in problem.states[:, t].unique():
            rows = problem.states[:, t] == state
            for a in range(problem.vocab):
                pick = rows & (problem.sequences[:, t] == a)
                table[state, a] = torch.logsumexp(logp[pick], 0) if pick.any() else float("-inf")
    return torch.log_softmax(table, -1).clamp_min(-1e3)


def _outcome(name: str, state: TabularProblem, rewards, beta, steps, converged, norm) -> Outcome:
    with torch.no_grad():
        logp = sequence_log_probs(state, state.policy_table)
        ref = sequence_log_probs(state, state.reference_table)
        table = state.policy_table
        return Outcome(
            name,
            steps,
            converged,
            _kl(logp, optimum_log_probs(state, rewards, beta)),
            _kl(logp, ref),
            float((logp.exp() * rewards).sum()),
            norm,
            float(table.max() - table.min()),
        )


def dynamics_problem(vocab: int, length: int, seed: int = 0, scale: float = 1.0) -> tuple[TabularProblem, torch.Tensor]:
    """A tabular problem and a reward in [0, 1] on whole sequences (random, seeded)."""
    problem = TabularProblem.random(vocab, length, seed, scale)
    g = torch.Generator().manual_seed(seed + 10_000)
    return problem, torch.rand(len(problem.sequences), generator=g, dtype=torch.float64)


@dataclass
class DynamicsRow:
    outcome: Outcome
    mode: str  # on_policy | off_policy
    verdict: str  # the audit's verdict at pi = pi_ref
    fixed_point: str


def exact_dynamics(
    problem: TabularProblem,
    rewards: torch.Tensor,
    beta: float,
    off_policy: bool,
    configs: list,
    lr: float = 2.0,
    steps: int = 3000,
    traces: Optional[dict] = None,
    corrections: tuple[Correction, ...] = (),
) -> list[DynamicsRow]:
    """One row per configuration (and beta = 0 as the control), each trained from pi_ref; a KL configuration with
    ``off_policy='behavior'`` gets one row per behaviour correction in ``corrections``; RPG losses are judged by
    :func:`verdict_of`. ``traces`` (a dict) receives each row's KL(pi || pi*) per step under its name."""
    kl_configs = [cfg for cfg in configs if isinstance(cfg, KLConfig)]
    verdicts = {row.name: row.verdict for row in audit(problem, off_policy, kl_configs, corrections)}
    verdicts.update({cfg.name: verdict_of(problem, cfg, off_policy) for cfg in configs if isinstance(cfg, RPGConfig)})
    optimum = optimum_table(problem, rewards, beta)
    optimum_range = float(optimum.max() - optimum.min())
    pairs = [
        (cfg, c)
        for cfg in [None, *configs]
        for c in (corrections if isinstance(cfg, KLConfig) and cfg.off_policy == "behavior" else (None,))
    ]
    rows = []
    for cfg, correction in pairs:
        trace = [] if traces is not None else None
        outcome = train_exact(
            problem, rewards, beta, cfg, lr=lr, steps=steps, off_policy=off_policy, trace=trace, correction=correction
        )
        if traces is not None:
            traces[outcome.name] = trace
        rows.append(
            DynamicsRow(
                outcome,
                "off_policy" if off_policy else "on_policy",
                verdicts.get(outcome.name, "beta = 0 (control)"),
                outcome.fixed_point(optimum_range),
            )
        )
    return rows


def format_dynamics(rows: list[DynamicsRow]) -> str:
    width = max([36] + [len(r.outcome.name) for r in rows])
    header = (
        f"{'configuration':{width}s} {'audit verdict':22s} {'steps':>6s} {'KL(pi||pi*)':>12s} "
        f"{'KL(pi||ref)':>12s} {'E[r]':>7s}  fixed point"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        o = r.outcome
        lines.append(
            f"{o.name:{width}s} {r.verdict:22s} {o.steps:6d} {max(o.kl_to_optimum, 0.0):12.3e} "
            f"{o.kl_to_reference:12.4f} {o.expected_reward:7.4f}  {r.fixed_point}"
        )
    return "\n".join(lines)


@dataclass
class SampledOutcome:
    """A configuration trained with sampled minibatches over several seeds (on-policy)."""

    name: str
    seeds: int
    final_kl_to_optimum: list  # per seed, KL(pi_final || pi*)
    final_kl_to_reference: list
    unstable: int  # seeds with an instability event: KL(pi || pi_ref) > factor x KL(pi* || pi_ref), or non-finite


def train_sampled(
    problem: TabularProblem,
    rewards: torch.Tensor,
    beta: float,
    cfg: Optional[KLConfig],
    batch: int = 64,
    steps: int = 1500,
    lr: float = 0.5,
    seeds: int = 5,
    instability_factor: float = 5.0,
) -> SampledOutcome:
    """On-policy training with the estimators as the trainer computes them: each step draws ``batch`` sequences
    from pi, the reward's REINFORCE estimate with the batch-mean baseline (GRPO's group mean) plus the
    configuration's minibatch KL-gradient estimate (sum over the drawn rows / batch). The instability event is
    defined before any run: KL(pi || pi_ref) above ``instability_factor`` times the optimum's, or a non-finite
    value, at any step."""
    optimum = optimum_log_probs(problem, rewards, beta)
    reference = sequence_log_probs(problem, problem.reference_table)
    bound = instability_factor * _kl(optimum, reference)
    cfg_at_beta = dataclasses.replace(cfg, coef=beta) if cfg is not None else None
    finals, drift, unstable = [], [], 0
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        table = problem.reference_table.clone().requires_grad_(True)
        state = dataclasses.replace(problem, policy_table=table)
        event = False
        for _ in range(steps):
            probs = sequence_log_probs(state, table).exp().detach()
            draws = torch.multinomial(probs, batch, replacement=True, generator=g)
            weights = torch.bincount(draws, minlength=len(probs)).to(probs.dtype) / batch
            baseline = float((weights * rewards).sum())
            d = reward_gradient(state, rewards - baseline, weights)
            if cfg_at_beta is not None:
                d = d - beta * kl_gradient(state, cfg_at_beta, weights)
            with torch.no_grad():
                table += lr * d
                kl_ref = _kl(sequence_log_probs(state, table), reference)
            if not math.isfinite(kl_ref) or kl_ref > bound:
                event = True
                if not math.isfinite(kl_ref):
                    break
        with torch.no_grad():
            logp = sequence_log_probs(state, table)
            finals.append(_kl(logp, optimum))
            drift.append(_kl(logp, reference))
        unstable += int(event)
    return SampledOutcome(row_name(cfg), seeds, finals, drift, unstable)


def format_sampled(rows: list[tuple[SampledOutcome, str]]) -> str:
    """(outcome, audit verdict) rows: mean and spread over seeds of the final KLs, the instability count."""
    width = max([36] + [len(o.name) for o, _ in rows])
    header = (
        f"{'configuration':{width}s} {'audit verdict':22s} {'KL(pi||pi*) mean':>17s} {'(min, max)':>18s} "
        f"{'KL(pi||ref)':>12s} {'unstable':>9s}"
    )
    lines = [header, "-" * len(header)]
    for o, verdict in rows:
        kl_opt = [max(v, 0.0) for v in o.final_kl_to_optimum]
        lines.append(
            f"{o.name:{width}s} {verdict:22s} {sum(kl_opt) / len(kl_opt):17.4f} "
            f"({min(kl_opt):7.4f}, {max(kl_opt):7.4f}) {sum(o.final_kl_to_reference) / o.seeds:12.4f} "
            f"{o.unstable:>5d}/{o.seeds}"
        )
    return "\n".join(lines)


# the stale-sample runs' instability event: E_pi[r] (rewards in [0, 1]) falls this far below its best value so far
COLLAPSE_DROP = 0.25


@dataclass
class StaleOutcome:
    """A configuration trained on samples from a policy ``staleness`` steps old, over several seeds."""

    name: str
    staleness: int
    correction: str  # the behaviour correction's label on the reward's policy gradient
    seeds: int
    final_reward: list  # per seed, E_pi[r] at the end
    final_kl_to_reference: list
    final_kl_to_optimum: list  # KL(pi_final || pi*) (beta = 0: pi* of the same beta, for comparison)
    unstable: int  # seeds with an instability event (:func:`train_stale`)


def token_log_probs(problem: TabularProblem, table: torch.Tensor) -> torch.Tensor:
    """log pi(y_t | s_t) of every sequence and position [N, T]."""
    return problem.log_probs(table).gather(-1, problem.sequences[..., None])[..., 0]


def train_stale(
    problem: TabularProblem,
    rewards: torch.Tensor,
    beta: float,
    cfg: Optional[KLConfig],
    staleness: int,
    correction=None,
    batch: int = 64,
    steps: int = 800,
    lr: float = 0.5,
    seeds: int = 5,
    collapse_drop: float = COLLAPSE_DROP,
    trace: Optional[list] = None,
) -> StaleOutcome:
    """Asynchronous training as the trainer runs it with ``train.staleness = s``: each step draws ``batch``
    sequences from mu = pi_{t-s} (the policy s updates ago; pi_ref before that), the reward's policy gradient is
    sum_y w(y) sum_t c_t (r(y) - b) grad log pi(y_t | s_t) with the batch-mean baseline b and the behaviour
    correction's weights c_t from pi / mu (``correction``, a kl.corrections.Correction; None: c = 1), and the KL
    term is the configuration's minibatch estimate with mu's log-probs as its behaviour log-probs (its own
    kl.off_policy correction). s = 0 is on-policy.

    The instability event is defined before any run and is the same with and without a KL term: a non-finite
    value, or a reward collapse: the exact E_pi[r] falls more than ``collapse_drop`` below the best value the run
    had reached. ``trace`` (a list) receives one list per seed: E_pi[r] after every step."""
    optimum = optimum_log_probs(problem, rewards, beta)
    reference = sequence_log_probs(problem, problem.reference_table)
    cfg_at_beta = dataclasses.replace(cfg, coef=beta) if cfg is not None else None
    mask = torch.ones_like(problem.sequences, dtype=torch.bool)
    finals, drift, to_optimum, unstable = [], [], [], 0
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        table = problem.reference_table.clone().requires_grad_(True)
        history = deque([problem.reference_table.clone()] * (staleness + 1), maxlen=staleness + 1)
        best, event = -math.inf, False
        seed_trace = [] if trace is not None else None
        if trace is not None:
            trace.append(seed_trace)
        for _ in range(steps):
            state = dataclasses.replace(problem, policy_table=table, behavior_table=history[0])
            behavior = token_log_probs(problem, history[0])
            draws = torch.multinomial(behavior.sum(-1).exp(), batch, replacement=True, generator=g)
            weights = torch.bincount(draws, minlength=len(rewards)).to(rewards.dtype) / batch
            advantage = rewards - float((weights * rewards).sum())
            logp = token_log_probs(problem, table)
            c = None if correction is None else correction.weights(logp.detach(), behavior, mask)[0]
            surrogate = (weights * advantage)[:, None] * logp * (1.0 if c is None else c)
            (d,) = torch.autograd.grad(surrogate.sum(), table)
            if cfg_at_beta is not None:
                d = d - beta * kl_gradient(state, cfg_at_beta, weights, off_policy=True)
            with torch.no_grad():
                table += lr * d
                history.append(table.detach().clone())
                logp_seq = sequence_log_probs(problem, table)
                reward = float((logp_seq.exp() * rewards).sum())
                if seed_trace is not None:
                    seed_trace.append(reward)
            if not math.isfinite(reward) or not bool(torch.isfinite(table).all()):
                event = True
                break
            best = max(best, reward)
            event = event or reward < best - collapse_drop
        with torch.no_grad():
            logp_seq = sequence_log_probs(problem, table)
            finals.append(float((logp_seq.exp() * rewards).sum()))
            drift.append(_kl(logp_seq, reference))
            to_optimum.append(_kl(logp_seq, optimum))
        unstable += int(event)
    label = "none" if correction is None else correction.label
    return StaleOutcome(row_name(cfg), staleness, label, seeds, finals, drift, to_optimum, unstable)


# The configurations the stale-sample table trains by default: the control, the unbiased sequence-level ones and
# their per-decision off-policy forms, and the two most used biased ones (k3 in the loss per token, k3 in the reward).
STALE_CONFIGS = (
    "k1-reward-token-rtg",
    "k1-reward-token-rtg-per_decision",
    "k2-loss-sequence",
    "full-loss-sequence-per_decision",
    "k3-loss-token",
    "k3-reward-token-rtg",
)


def format_stale(rows: list[tuple[StaleOutcome, str]]) -> str:
    """(outcome, off-policy audit verdict) rows: final E[r] and KLs over seeds, the instability count."""
    width = max([34] + [len(o.name) for o, _ in rows])
    header = (
        f"{'stale':>5s} {'correction':22s} {'configuration':{width}s} {'audit verdict':22s} "
        f"{'E[r] mean':>9s} {'(min, max)':>16s} {'KL(pi||ref)':>11s} {'KL(pi||pi*)':>11s} {'unstable':>9s}"
    )
    lines = [header, "-" * len(header)]
    for o, verdict in rows:
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        lines.append(
            f"{o.staleness:5d} {o.correction:22s} {o.name:{width}s} {verdict:22s} {mean(o.final_reward):9.4f} "
            f"({min(o.final_reward):6.4f}, {max(o.final_reward):6.4f}) {mean(o.final_kl_to_reference):11.4f} "
            f"{mean(o.final_kl_to_optimum):11.4f} {o.unstable:>5d}/{o.seeds}"
        )
    return "\n".join(lines)
