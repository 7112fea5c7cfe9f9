"""Command line of the exact gradient audit (`megatron-kl audit`, `python tools/grad_audit.py`).

    python tools/grad_audit.py --vocab 3 --length 3 --seed 0 [--json out.json]

Prints, for on-policy and off-policy sampling, the relative bias and cosine of each configuration's
expected gradient against the sequence-level reverse KL, the prefix-frozen token-level reverse KL and the
token-level forward KL, the per-sample gradient variance, and a verdict. A third and fourth table pair
every configuration with each behaviour correction (algo.behavior_correction) applied to its KL term
(kl.off_policy=behavior), on- and off-policy; ``--no-corrections`` leaves them out. With ``--top-k`` /
``--top-p`` two more tables sample from the truncated policy mu = trunc(pi) and judge every configuration against
the gradients of mu's KLs, once with the estimators seeing log mu (rollout.sampling.distribution=truncated) and
once log pi (distribution=full). With ``--mixed-switch K`` three more tables sample each response's first K tokens
from one behaviour policy and the rest from another (a response resumed across a weight update: rollout.partial) and
give the estimators the behaviour log-probs per token, or one version's for the whole response (first / last).

``--teacher`` audits distillation instead: the other table is a teacher's (``--sharpness`` times sharper than the
student, drawn independently), every configuration judged for the KL to the teacher on- and off-policy, then the named
recipes (the exact reverse KL in the loss, sampled k1 as a per-token reward, ...) with the KL each one's gradient
estimates (kl/audit/distill.py).

``--dynamics`` trains instead: every configuration from pi = pi_ref by gradient ascent with its exact expected
direction on E_pi[r] - beta KL(pi || pi_ref) (a random reward on whole sequences), and reports where it ends
against the closed-form optimum pi* (kl/audit/dynamics.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_kl.cli_help import Parser
from megatron_kl.kl.audit.distill import format_recipes, recipe_verdicts, teacher_problem
from megatron_kl.kl.audit.dynamics import (
    COLLAPSE_DROP,
    STALE_CONFIGS,
    dynamics_problem,
    exact_dynamics,
    format_dynamics,
    format_sampled,
    format_stale,
    rpg_configs,
    train_sampled,
    train_stale,
)
from megatron_kl.kl.audit.exact import (
    RECORDED,
    TabularProblem,
    all_configs,
    audit,
    behavior_configs,
    format_table,
    summarize,
)
from megatron_kl.kl.audit.figures import exact_figure, stale_figure
from megatron_kl.kl.corrections import CORRECTIONS, Correction, canonical
from megatron_kl.vocab_parallel.truncation import Truncation

_RECORDED_WORDS = {
    "per_token": "each token's own behaviour log-prob (what the trainer records)",
    "first": "mu_1's log-probs for every token (one version per response: the first)",
    "last": "mu_2's log-probs for every token (one version per response: the last)",
}


def main(argv=None) -> int:
    parser = Parser(prog="megatron-kl audit", description=__doc__)
    parser.add_argument("--vocab", type=int, default=3, help="tokens in the tabular policy's vocabulary (default 3)")
    parser.add_argument(
        "--length",
        type=int,
        default=3,
        help="tokens per sequence; every sequence of this length is enumerated (default 3)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random policy, reference and reward tables")
    parser.add_argument("--truncate", type=float, default=None, help="cap on per-decision weights")
    parser.add_argument("--json", type=str, default=None, metavar="FILE", help="also write every table as JSON to FILE")
    parser.add_argument("--no-corrections", action="store_true", help="skip the behaviour-correction tables")
    parser.add_argument("--top-k", type=int, default=0, help="truncated-sampler tables: top-k of the sampler")
    parser.add_argument("--top-p", type=float, default=1.0, help="truncated-sampler tables: top-p of the sampler")
    parser.add_argument(
        "--mixed-switch",
        type=int,
        default=0,
        metavar="K",
        help="mixed-behaviour tables: tokens before K from one behaviour policy, the rest from another",
    )
    parser.add_argument(
        "--teacher",
        action="store_true",
        help="audit distillation: every configuration of the KL "
        "term to a tabular teacher, and the named distillation recipes",
    )
    parser.add_argument(
        "--sharpness",
        type=float,
        default=3.0,
        help="--teacher: the teacher's logit scale against the student's (default 3)",
    )
    parser.add_argument("--dynamics", action="store_true", help="exact training dynamics of every configuration")
    parser.add_argument("--beta", type=float, default=0.5, help="--dynamics: the KL coefficient")
    parser.add_argument("--lr", type=float, default=2.0, help="--dynamics: step size on the logit table")
    parser.add_argument("--steps", type=int, default=3000, help="--dynamics: step budget per configuration")
    parser.add_argument(
        "--sampled",
        type=int,
        default=0,
        metavar="B",
        help="--dynamics: also train on-policy with sampled minibatches of B sequences (the "
        "estimators as the trainer computes them), --seeds seeds, step --sampled-lr",
    )
    parser.add_argument("--seeds", type=int, default=5, help="--sampled: seeds per configuration")
    parser.add_argument("--sampled-lr", type=float, default=0.5, help="--sampled: step size")
    parser.add_argument("--sampled-steps", type=int, default=800, help="--sampled: steps per seed")
    parser.add_argument(
        "--stale",
        type=int,
        nargs="+",
        default=[],
        metavar="S",
        help="--sampled: also train asynchronously on samples from the policy S steps old, for "
        "each S, with and without a KL term and with each --stale-corrections on the reward",
    )
    parser.add_argument(
        "--stale-corrections",
        nargs="+",
        default=["none", "sequence_tis"],
        choices=CORRECTIONS,
        help="--stale: behaviour corrections (algo.behavior_correction; the truncated-IS kinds "
        "uncapped, their unbiased limit)",
    )
    parser.add_argument(
        "--stale-configs",
        nargs="+",
        default=None,
        help="--stale: configuration names (default: kl/audit/dynamics.py STALE_CONFIGS)",
    )
    parser.add_argument(
        "--behavior",
        nargs="+",
        default=[],
        choices=CORRECTIONS,
        metavar="KIND",
        help="--dynamics: add to the off-policy table every configuration with each behaviour "
        "correction KIND on its KL term (kl.off_policy=behavior; truncated-IS kinds uncapped)",
    )
    parser.add_argument(
        "--figures",
        type=str,
        default=None,
        metavar="DIR",
        help="--dynamics: write dynamics-exact.png (KL to pi* per step) and, with --stale, "
        "dynamics-stale.png (E[r] per step of every seed) into DIR",
    )
    parser.add_argument(
        "--stale-only",
        action="store_true",
        help="--stale: print the stale-sample table only (skip the exact and on-policy tables)",
    )
    args = parser.parse_args(argv)
    if args.dynamics:
        return _dynamics(args)
    if args.teacher:
        return _teacher(args)
    problem = TabularProblem.random(args.vocab, args.length, args.seed)
    rows, summary = [], []
    sections = [(off, False) for off in (False, True)]
    if not args.no_corrections:
        sections += [(off, True) for off in (False, True)]
    for off, corrected in sections:
        configs = behavior_configs() if corrected else all_configs(off, truncate=args.truncate)
        part = audit(problem, off_policy=off, configs=configs)
        print(
            f"\n== {'off-policy (samples from mu)' if off else 'on-policy'}"
            f"{', behaviour corrections on the KL term' if corrected else ''}: V={args.vocab} T={args.length} "
            f"seed={args.seed} ({args.vocab**args.length} sequences, exact sums, float64)"
        )
        print(format_table(part))
        rows += part
        summary.append((f"{'off' if off else 'on'}-policy{' + behaviour corrections' if corrected else ''}", part))
    if args.mixed_switch:
        for recorded in RECORDED:
            mixed = TabularProblem.mixed(args.vocab, args.length, args.seed, args.mixed_switch, recorded)
            part = audit(
                mixed,
                off_policy=True,
                configs=all_configs(True, truncate=args.truncate) + ([] if args.no_corrections else behavior_configs()),
            )
            print(
                f"\n== mixed behaviour: tokens < {args.mixed_switch} from mu_1, the rest from mu_2; the estimators "
                f"are given {_RECORDED_WORDS[recorded]}: V={args.vocab} T={args.length} seed={args.seed}"
            )
            print(format_table(part))
            rows += part
            summary.append((f"mixed behaviour ({recorded})", part))
    rule = Truncation(args.top_k, args.top_p)
    if rule.active(args.vocab):
        for trained in ("truncated", "full"):
            part = audit(
                dataclasses.replace(problem, truncation=rule, trained=trained),
                off_policy=False,
                configs=all_configs(False),
            )
            print(
                f"\n== samples from mu = trunc(pi) (top_k={args.top_k}, top_p={args.top_p}), estimators see "
                f"{'log mu' if trained == 'truncated' else 'log pi (full softmax)'}; targets: mu's KLs "
                f"(forward KL(pi_ref || mu) is infinite: nan): V={args.vocab} T={args.length} seed={args.seed}"
            )
            print(format_table(part))
            rows += part
            summary.append(
                (f"truncated sampler, estimators see {'log mu' if trained == 'truncated' else 'log pi'}", part)
            )
    print(summarize(summary))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(f"\nwrote {args.json}")
    return 0


def _dynamics(args) -> int:
    problem, rewards = dynamics_problem(args.vocab, args.length, args.seed)
    if args.stale and not args.sampled:
        raise SystemExit("--stale needs --sampled B (the batch of each stale-sample step)")
    if args.stale_only:
        if not args.stale:
            raise SystemExit("--stale-only needs --stale S [S ...]")
        _stale(args, problem, rewards)
        return 0
    rows, sections = [], []
    for off in (False, True):
        traces = {} if args.figures else None
        configs = all_configs(off) + rpg_configs() + (behavior_configs() if off and args.behavior else [])
        part = exact_dynamics(
            problem,
            rewards,
            args.beta,
            off,
            configs,
            lr=args.lr,
            steps=args.steps,
            traces=traces,
            corrections=_corrections(args.behavior) if off else (),
        )
        sections.append(("off-policy" if off else "on-policy", part, traces))
        print(
            f"\n== exact dynamics, {'off-policy (KL term estimated from a fixed mu)' if off else 'on-policy'}: "
            f"V={args.vocab} T={args.length} seed={args.seed} beta={args.beta} lr={args.lr} steps<={args.steps}; "
            "from pi = pi_ref, d = grad E[r] - beta E[g_KL]"
        )
        print(format_dynamics(part))
        rows += part
    if args.figures:
        print(f"\nwrote {exact_figure(sections, Path(args.figures))}")
    if args.sampled:
        verdicts = {r.outcome.name: r.verdict for r in rows if r.mode == "on_policy"}  # the control's included
        sampled = [
            (outcome, verdicts[outcome.name])
            for outcome in (
                train_sampled(
                    problem,
                    rewards,
                    args.beta,
                    cfg,
                    batch=args.sampled,
                    steps=args.sampled_steps,
                    lr=args.sampled_lr,
                    seeds=args.seeds,
                )
                for cfg in [None, *all_configs(False), *rpg_configs()]
            )
        ]
        print(
            f"\n== sampled on-policy training: batch {args.sampled}, {args.seeds} seeds, lr {args.sampled_lr}, "
            f"{args.sampled_steps} steps; reward by REINFORCE with the batch-mean baseline; unstable = a seed whose "
            "KL(pi || pi_ref) exceeded 5x the optimum's (or a non-finite value) at any step"
        )
        print(format_sampled(sampled))
        if args.stale:
            _stale(args, problem, rewards)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {**asdict(r.outcome), "mode": r.mode, "verdict": r.verdict, "fixed_point": r.fixed_point}
                    for r in rows
                ],
                indent=1,
            )
        )
        print(f"\nwrote {args.json}")
    return 0


def _teacher(args) -> int:
    problem = teacher_problem(args.vocab, args.length, args.seed, args.sharpness)
    rows, summary = [], []
    sections = [(off, False) for off in (False, True)] + ([] if args.no_corrections else [(True, True)])
    for off, corrected in sections:
        configs = behavior_configs() if corrected else all_configs(off, truncate=args.truncate)
        part = audit(problem, off_policy=off, configs=configs)
        print(
            f"\n== distillation, {'off-policy (samples from mu)' if off else 'on-policy'}"
            f"{', behaviour corrections on the term' if corrected else ''}: the KL term's other distribution is a "
            f"tabular teacher ({args.sharpness:g}x sharper, drawn apart from the student): V={args.vocab} "
            f"T={args.length} seed={args.seed}; bias:seq is against grad KL(pi || teacher)"
        )
        print(format_table(part))
        rows += part
        summary.append((f"distillation {'off' if off else 'on'}-policy{' + corrections' if corrected else ''}", part))
        if not corrected:
            print(format_recipes(recipe_verdicts(problem, off), f"\n-- the recipes, {'off' if off else 'on'}-policy"))
    print(summarize(summary))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(f"\nwrote {args.json}")
    return 0


def _corrections(kinds: list[str]) -> tuple:
    """Behaviour corrections by kind at their defaults, the truncated-IS kinds uncapped (their unbiased limit)."""
    return tuple(
        Correction(kind, tis_cap=math.inf) if canonical(kind).endswith("_tis") else Correction(kind) for kind in kinds
    )


def _stale(args, problem, rewards) -> None:
    configs = {cfg.name: cfg for cfg in all_configs(True)}
    names = args.stale_configs or list(STALE_CONFIGS)
    unknown = [name for name in names if name not in configs]
    if unknown:
        raise SystemExit(f"--stale-configs: unknown configuration(s) {unknown}; known: {sorted(configs)}")
    verdicts = {row.name: row.verdict for row in audit(problem, True, [configs[name] for name in names])}
    corrections = [
        None if canonical(kind) == "none" else correction
        for kind, correction in zip(args.stale_corrections, _corrections(args.stale_corrections))
    ]
    rows, panels = [], {}
    for staleness in args.stale:
        for correction in corrections:
            for name in [None, *names]:
                trace = [] if args.figures else None
                outcome = train_stale(
                    problem,
                    rewards,
                    args.beta,
                    configs.get(name),
                    staleness,
                    correction,
                    batch=args.sampled,
                    steps=args.sampled_steps,
                    lr=args.sampled_lr,
                    seeds=args.seeds,
                    collapse_drop=COLLAPSE_DROP,
                    trace=trace,
                )
                rows.append((outcome, verdicts.get(outcome.name, "beta = 0 (control)")))
                if trace is not None:
                    panels.setdefault((staleness, outcome.correction), {})[outcome.name] = trace
    print(
        f"\n== stale samples (train.staleness = S: samples from the policy S updates old): batch {args.sampled}, "
        f"{args.seeds} seeds, lr {args.sampled_lr}, {args.sampled_steps} steps, beta {args.beta}; the correction "
        "weighs the reward's policy gradient, the KL term uses its own kl.off_policy; unstable = a seed whose "
        f"E_pi[r] fell more than {COLLAPSE_DROP} below its best (or a non-finite value); verdicts: the off-policy "
        "audit"
    )
    print(format_stale(rows))
    if args.figures:
        print(f"\nwrote {stale_figure(panels, Path(args.figures))}")


if __name__ == "__main__":
    sys.exit(main())
