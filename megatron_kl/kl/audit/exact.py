"""Exact gradient audit of every KL configuration on a tabular autoregressive policy.

All V^T sequences are enumerated; the policy, the reference and the behaviour policy are tables of
logits indexed by the prefix (every prefix its own state), in float64. For each configuration the
per-sample gradient estimator g(y) is built through the public API (``kl_loss`` for loss placement;
``kl_shaped_returns`` + ``policy_gradient_surrogate`` for reward placement), and its exact expectation
E_q[g] = sum_y q(y) g(y) (q = pi on-policy, mu off-policy) and variance sum_y q(y) |g(y) - E_q[g]|^2
are compared with the exact gradients of

    seq           KL(pi || pi_ref) over whole sequences = E_pi[D]      (the objective's true KL)
    token         sum_t E_{s_t ~ q, frozen}[KL_t(s_t)]                  (prefix-frozen token-level reverse KL)
    forward       sum_t E_{s_t ~ q, frozen}[KL(pi_ref || pi)(s_t)]      (token-level forward KL)

Gradients are w.r.t. the policy's logit table and divided by ``coef`` so they estimate grad KL.

Behaviour corrections (algo.behavior_correction) are an axis of their own: a configuration with
off_policy='behavior' is audited once per :class:`~megatron_kl.kl.corrections.Correction`, its weights
computed from pi_old = pi (the policy at the audit point) and the sampler (mu off-policy, pi on-policy).

Truncated sampler (``TabularProblem.truncation``): the samples come from mu = trunc(pi) (top-k / top-p on each
state's logits, renormalised: the engines' rule, ``vocab_parallel.truncation``), the behaviour log-probs are log mu, and the
targets are the gradients of the sampled policy's KLs (KL(mu || pi_ref); the forward KL(pi_ref || mu) is infinite
and left out). ``trained='truncated'`` gives the estimators log mu (rollout.sampling.distribution=truncated),
``'full'`` gives them log pi (distribution=full). Only sequences with mu(y) > 0 are enumerated.

Mixed behaviour (``TabularProblem.mixed``; partial rollouts, rollout.partial): the first ``switch`` tokens of every
sequence are sampled by one behaviour policy mu_1 and the rest by another, mu_2 (a response paused at a weight
update and resumed with the next weights): the sampler is q(y) = prod_{t<k} mu_1(y_t|s_t) prod_{t>=k} mu_2(y_t|s_t),
the off-policy targets take their states from it. ``recorded`` is what the estimators are told the behaviour
log-probs were: ``per_token`` (each token's own policy: what the trainer records), ``first`` or ``last`` (one policy
for the whole response, as bookkeeping of one version per response would). Importance weights built from the
recorded log-probs are exact only when they are the sampler's: per-decision weights rho_t = pi/mu_t(y_t) and the
sequence ratio prod_t pi/mu_t(y_t) stay unbiased with per-token mu and are biased with either single version.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from megatron_kl.kl.config import ESTIMATORS, TOP_K, UNBIASED_TOL, TopKConfig
from megatron_kl.kl.config import TARGETS as KL_TARGETS
from megatron_kl.kl.corrections import AUDITED, Correction
from megatron_kl.kl.objective import (
    CREDITS,
    LEVELS,
    OFF_POLICY,
    PLACEMENTS,
    KLConfig,
    kl_loss,
    kl_shaped_returns,
    policy_gradient_surrogate,
)
from megatron_kl.kl.sequence_axis import crossing
from megatron_kl.kl.topk import top_k_divergence
from megatron_kl.vocab_parallel.truncation import Truncation, support_threshold

TARGETS = tuple(KL_TARGETS.values())  # the audit's names of kl.target's values: seq, token, forward
RECORDED = ("per_token", "first", "last")  # mixed behaviour: the behaviour log-probs the estimators are given


@dataclass
class TabularProblem:
    vocab: int
    length: int
    sequences: torch.Tensor  # [N, T]
    states: torch.Tensor  # [N, T] state index of each prefix
    policy_table: torch.Tensor  # [S, V] logits, requires grad
    reference_table: torch.Tensor
    behavior_table: torch.Tensor
    truncation: Optional[Truncation] = None  # the on-policy sampler is trunc(pi) (module docstring)
    trained: str = "truncated"  # with truncation: the estimators see log mu (truncated) or log pi (full)
    # mixed behaviour (module docstring): positions >= switch sampled by second_behavior_table's policy
    second_behavior_table: Optional[torch.Tensor] = None
    switch: Optional[int] = None
    recorded: str = "per_token"  # per_token | first | last: the behaviour log-probs the estimators are given

    @classmethod
    def random(cls, vocab: int = 3, length: int = 3, seed: int = 0, scale: float = 1.0) -> "TabularProblem":
        g = torch.Generator().manual_seed(seed)
        seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)), dtype=torch.long)
        offsets = [sum(vocab**k for k in range(t)) for t in range(length)]
        states = torch.zeros_like(seqs)
        for t in range(length):
            prefix_code = torch.zeros(len(seqs), dtype=torch.long)
            for u in range(t):
                prefix_code = prefix_code * vocab + seqs[:, u]
            states[:, t] = offsets[t] + prefix_code
        n_states = sum(vocab**k for k in range(length))

        def table():
            return scale * torch.randn(n_states, vocab, generator=g, dtype=torch.float64)

        return cls(vocab, length, seqs, states, table().requires_grad_(True), table(), table())

    @classmethod
    def mixed(
        cls, vocab: int = 3, length: int = 3, seed: int = 0, switch: int = 1, recorded: str = "per_token"
    ) -> "TabularProblem":
        """A random problem whose samples come from one behaviour policy before position ``switch`` and from a
        second one (a fresh random table) from there on."""
        if recorded not in RECORDED or not 0 < switch < length:
            raise ValueError(f"recorded in {RECORDED} and 0 < switch < length={length}")
        base = cls.random(vocab, length, seed)
        second = torch.randn(
            base.behavior_table.shape, generator=torch.Generator().manual_seed(10_000 + seed), dtype=torch.float64
        )
        return dataclasses.replace(base, second_behavior_table=second, switch=switch, recorded=recorded)

    def behavior_log_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, T, V] the sampler's per-position log-distributions off-policy, and those the estimators are told
        (the same unless ``recorded`` names one version for a mixed-behaviour response)."""
        first = self.log_probs(self.behavior_table)
        if self.switch is None:
            return first, first
        second = self.log_probs(self.second_behavior_table)
        sampler = torch.cat([first[:, : self.switch], second[:, self.switch :]], dim=1)
        return sampler, {"per_token": sampler, "first": first, "last": second}[self.recorded]

    def log_probs(self, table: torch.Tensor) -> torch.Tensor:
        """[N, T, V] per-position log-distributions."""
        return torch.log_softmax(table[self.states], dim=-1)

    def support(self) -> torch.Tensor:
        """[S, V] the truncated sampler's support per state (everything without truncation)."""
        table = self.policy_table.detach()
        if self.truncation is None:
            return torch.ones_like(table, dtype=torch.bool)
        return table >= support_threshold(table, None, self.truncation)[:, None]

    def sampler_log_probs(self) -> torch.Tensor:
        """[N, T, V] log mu (-inf outside the support), differentiable w.r.t. the policy table."""
        return torch.log_softmax(self.policy_table.masked_fill(~self.support(), float("-inf"))[self.states], dim=-1)


@dataclass
class AuditRow:
    name: str
    mode: str  # on_policy | off_policy
    config: dict
    rel_bias: dict  # target -> |E[g] - grad| / |grad|
    cosine: dict
    variance: float
    verdict: str
    correction: Optional[str] = None  # the behaviour correction's label for off_policy='behavior' rows


def _kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """sum_a p_a (log p_a - log q_a) per position; 0 where p_a = 0 (log p_a = -inf)."""
    inside = torch.isfinite(logp)
    safe = torch.where(inside, logp, torch.zeros_like(logp))  # no -inf in either branch: finite gradients
    return torch.where(inside, safe.exp() * (safe - logq), torch.zeros_like(logp)).sum(-1)


def _quantities(problem: TabularProblem):
    """Per sequence and position (sequences the sampler can draw): the log-probs the estimators see, the
    reference's, the sampler's (mu off-policy; on-policy pi, or trunc(pi) with a truncated sampler), the exact
    KL of the estimators' distribution and of the sampler's to the reference, and the forward KL."""
    logq = problem.log_probs(problem.reference_table)
    y = problem.sequences[..., None]
    if problem.truncation is not None:
        logmu = problem.sampler_log_probs()
        logp = logmu if problem.trained == "truncated" else problem.log_probs(problem.policy_table)
        sampled = torch.isfinite(logmu.gather(-1, y)[..., 0]).all(-1)
        recorded = logmu
    else:
        logp = problem.log_probs(problem.policy_table)
        logmu, recorded = problem.behavior_log_probs()
        sampled = torch.ones(len(problem.sequences), dtype=torch.bool)
    pick = lambda t: t.gather(-1, y)[..., 0][sampled]  # noqa: E731
    full_kl = _kl_rows(logp, logq)[sampled]
    sampler_kl = _kl_rows(logmu, logq)[sampled]
    forward_kl = (logq.exp() * (logq - logp)).sum(-1)[sampled]
    return pick(logp), pick(logq), pick(logmu), full_kl, sampler_kl, forward_kl, pick(recorded)


def exact_targets(problem: TabularProblem, off_policy: bool) -> dict[str, torch.Tensor]:
    """Gradients of the three KLs (module docstring); with a truncated sampler, of the sampler's KLs."""
    lp, ref_lp, mu_lp, full_kl, sampler_kl, forward_kl, _ = _quantities(problem)
    truncated = problem.truncation is not None
    if truncated:
        lp, full_kl = mu_lp, sampler_kl  # the sampled policy mu = trunc(pi) is differentiable w.r.t. the table
    seq_prob = lp.sum(-1).exp()
    q = (mu_lp.sum(-1).exp() if off_policy else seq_prob).detach()
    objectives = {
        "seq": (seq_prob * (lp - ref_lp).sum(-1)).sum(),
        "token": (q * full_kl.sum(-1)).sum(),
        "forward": (q * forward_kl.sum(-1)).sum(),
    }
    targets = {k: torch.autograd.grad(v, problem.policy_table, retain_graph=True)[0] for k, v in objectives.items()}
    if truncated:  # KL(pi_ref || mu) is infinite (pi_ref has mass outside mu's support)
        targets["forward"] = torch.full_like(targets["forward"], float("nan"))
    return targets


def top_k_rows(problem: TabularProblem, k: int, tail: str) -> torch.Tensor:
    """Per sequence and position, the top-k divergence (megatron_kl.kl.topk) of the policy to the other table known
    on that table's ``k`` most likely tokens: the per-position value of a ``topk`` distillation term."""
    if problem.truncation is not None:
        raise ValueError("the top-k term is audited without a truncated sampler (the trainer refuses the pair)")
    logp, logq = problem.log_probs(problem.policy_table), problem.log_probs(problem.reference_table)
    ids = logq.detach().topk(k, dim=-1).indices
    return top_k_divergence(logp.gather(-1, ids), logq.gather(-1, ids), tail)


def _estimator_gradients(
    problem: TabularProblem, cfg: KLConfig, off_policy: bool, correction: Optional[Correction] = None
):
    """Per-sample gradients g(y) [N, S, V] of the configuration's estimator of grad KL, and q(y)."""
    lp, ref_lp, mu_lp, full_kl, _, _, recorded = _quantities(problem)
    sampler = mu_lp if off_policy or problem.truncation is not None else lp
    q = sampler.sum(-1).exp().detach()
    behavior = (recorded if off_policy else sampler).detach()  # what the trainer was told mu was
    mask = torch.ones(1, problem.length, dtype=torch.bool)
    weight = None
    if cfg.off_policy == "behavior":
        if correction is None:
            raise ValueError(f"{cfg.name}: off_policy='behavior' is audited with a behaviour correction")
        weight, _ = correction.weights(lp.detach(), behavior, torch.ones_like(lp, dtype=torch.bool))
    if isinstance(cfg, TopKConfig) and cfg.estimator == TOP_K:  # distill.kl.estimator=topk
        full_kl, cfg = top_k_rows(problem, cfg.top_k, cfg.top_k_tail), cfg.per_position()
    grads = []
    for n in range(len(lp)):
        sl = slice(n, n + 1)
        args = dict(behavior_logprobs=behavior[sl], full_kl=full_kl[sl] if cfg.exact else None)
        w = None if weight is None else weight[sl]
        if cfg.placement == "loss":
            estimate = kl_loss(cfg, lp[sl], ref_lp[sl], mask, behavior_weight=w, **args) / cfg.coef
        else:
            returns = kl_shaped_returns(cfg, torch.zeros(1, dtype=lp.dtype), lp[sl], ref_lp[sl], mask, **args)
            credit = -returns / cfg.coef
            estimate = policy_gradient_surrogate(
                cfg, lp[sl], credit, mask, behavior_logprobs=behavior[sl], behavior_weight=w
            )
        grads.append(torch.autograd.grad(estimate, problem.policy_table, retain_graph=True, allow_unused=True)[0])
    grads = [g if g is not None else torch.zeros_like(problem.policy_table) for g in grads]
    return torch.stack(grads), q


def all_configs(off_policy: bool, coef: float = 0.1, truncate: Optional[float] = None) -> list[KLConfig]:
    """Every configuration the API accepts (on-policy mode: off_policy='none' only), without the
    behaviour-correction rows (:func:`behavior_configs`)."""
    configs, seen = [], set()
    modes = tuple(op for op in OFF_POLICY if op != "behavior") if off_policy else ("none",)
    for est, place, level, credit, op in itertools.product(ESTIMATORS, PLACEMENTS, LEVELS, (None,) + CREDITS, modes):
        try:
            cfg = KLConfig(
                estimator=est,
                placement=place,
                level=level,
                credit=credit,
                off_policy=op,
                coef=coef,
                truncate=truncate if op == "per_decision" else None,
            )
        except ValueError:
            continue
        if cfg.name not in seen:
            seen.add(cfg.name)
            configs.append(cfg)
    return configs


def behavior_configs(coef: float = 0.1) -> list[KLConfig]:
    """Every configuration with the behaviour correction's weights on its KL term (off_policy='behavior')."""
    return [dataclasses.replace(cfg, off_policy="behavior") for cfg in all_configs(False, coef)]


def _verdict(rel_bias: dict, expectation_norm: float, scale: float) -> str:
    unbiased = [t for t in TARGETS if rel_bias[t] < UNBIASED_TOL]
    if unbiased:
        return "unbiased: " + ",".join(unbiased)
    if expectation_norm < UNBIASED_TOL * scale:
        return "zero expectation"
    return "biased"


def judge(expectation: torch.Tensor, targets: dict[str, torch.Tensor]) -> tuple[dict, dict, str]:
    """(relative bias, cosine, verdict) of an expected KL gradient against each target gradient."""
    rel, cos = {}, {}
    for name, target in targets.items():
        rel[name] = float((expectation - target).norm() / target.norm())
        denom = expectation.norm() * target.norm()
        cos[name] = float((expectation * target).sum() / denom) if denom > 0 else 0.0
    return rel, cos, _verdict(rel, float(expectation.norm()), float(targets["seq"].norm()))


def _mode(problem: TabularProblem, off_policy: bool) -> str:
    if problem.switch is not None and off_policy:
        return f"mixed-{problem.recorded}"  # two behaviour policies in one response; the estimators told ...
    if problem.truncation is not None:
        return f"mu-{problem.trained}"  # samples from trunc(pi); the estimators see log mu or log pi
    return "off_policy" if off_policy else "on_policy"


def audit(
    problem: TabularProblem,
    off_policy: bool,
    configs: Optional[list[KLConfig]] = None,
    corrections: tuple[Correction, ...] = AUDITED,
) -> list[AuditRow]:
    """One row per configuration; a configuration with off_policy='behavior' gets one row per correction."""
    targets = exact_targets(problem, off_policy)
    pairs = [
        (cfg, c)
        for cfg in configs or all_configs(off_policy)
        for c in (corrections if cfg.off_policy == "behavior" else (None,))
    ]
    rows = []
    for cfg, correction in pairs:
        grads, q = _estimator_gradients(problem, cfg, off_policy, correction)
        weights = q.view(-1, *([1] * (grads.dim() - 1)))
        expectation = (weights * grads).sum(0)
        variance = float((weights * (grads - expectation).square()).sum())
        rel, cos, verdict = judge(expectation, targets)
        rows.append(
            AuditRow(
                name=cfg.name + (f"[{correction.label}]" if correction else ""),
                mode=_mode(problem, off_policy),
                config=asdict(cfg),
                rel_bias=rel,
                cosine=cos,
                variance=variance,
                verdict=verdict,
                correction=correction.label if correction else None,
            )
        )
    return rows


def across_cp_ranks(row: AuditRow) -> str:
    """The row's ``kl.sequence_axis.crossing``: what its KL term needs from the other context-parallel ranks."""
    kind = re.match(r"[a-z_]+", row.correction).group(0) if row.correction else None
    return "+".join(crossing(KLConfig(**row.config), kind)) or "-"


def format_table(rows: list[AuditRow]) -> str:
    """The audit table; ``across CP`` names what crosses context-parallel ranks beyond the aggregation's sums
    (``kl.sequence_axis.crossing``: sum = an all-reduced per-sequence sum, prefix / suffix = an exclusive scan of
    chunk totals)."""
    width = max([38] + [len(r.name) for r in rows])
    header = (
        f"{'configuration':{width}s} {'mode':10s} "
        + " ".join(f"{'bias:' + t:>12s}" for t in TARGETS)
        + " "
        + " ".join(f"{'cos:' + t:>11s}" for t in TARGETS)
        + f" {'variance':>11s} {'across CP':>17s}  verdict"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.name:{width}s} {r.mode:10s} "
            + " ".join(f"{r.rel_bias[t]:12.3e}" for t in TARGETS)
            + " "
            + " ".join(f"{r.cosine[t]:11.3f}" for t in TARGETS)
            + f" {r.variance:11.3e} {across_cp_ranks(r):>17s}"
            + f"  {r.verdict}"
        )
    return "\n".join(lines)


def summarize(sections: list[tuple[str, list[AuditRow]]]) -> str:
    """The audit's closing summary: per section and per target, how many configurations are unbiased and biased,
    and the worst relative bias (with its configuration); a target a configuration cannot have (an infinite or
    undefined bias, e.g. the forward KL under truncation) is counted apart."""
    lines = ["", f"== summary (unbiased: relative bias < {UNBIASED_TOL:g})"]
    for title, rows in sections:
        lines.append(f"{title}, {len(rows)} configurations")
        for target in TARGETS:
            finite = [
                (r.rel_bias[target], r.name)
                for r in rows
                if r.rel_bias[target] == r.rel_bias[target] and r.rel_bias[target] != float("inf")
            ]
            unbiased = sum(bias < UNBIASED_TOL for bias, _ in finite)
            worst = max(finite, default=None)
            undefined = len(rows) - len(finite)
            lines.append(
                f"  {target:8s} {unbiased:4d} unbiased {len(finite) - unbiased:4d} biased"
                + (f"  worst {worst[0]:.2g} ({worst[1]})" if worst and worst[0] >= UNBIASED_TOL else "")
                + (f"  {undefined} undefined" if undefined else "")
            )
    return "\n".join(lines)
