"""FP8 rollouts against unquantized ones: the step-0 train-vs-rollout mismatch, and short training runs with and
without a behaviour correction.

    python tools/bench_fp8_rollouts.py [--mismatch cpu,smollm2] [--train-job cpu] [--train-seeds 1234 1]
                                       [--train-steps 60]

Mismatch: each job's first step with ``rollout.quantization`` none and fp8 (same seed, same prompts); printed from
its step-0 record: mean and max |log mu - log pi_old| per response token (``mismatch/abs_logprob_mean|max``) and
KL(mu || pi_old) per token (``mismatch/k1_token``: E_mu[log mu - log pi_old]; ``mismatch/k3_token``). Jobs: ``cpu``
(configs/cpu/default.yaml, float32, its shipped warm start) and ``smollm2`` (configs/cpu/smollm2-135m.yaml,
SmolLM2-135M-Instruct in bf16; prepare it as that file says).

Training: ``--train-job`` (``cpu`` or ``smollm2``, each with its config's own evaluation) for ``--train-steps`` steps
per seed in three arms - unquantized rollouts; FP8 rollouts with no
correction; FP8 rollouts with token TIS (``algo.behavior_correction=token_tis``) - printed side by side: the mean
train-vs-rollout gap over the run, the exact KL(pi || pi_ref) per token at the last step that computed it
(``kl/exact_token``), and the final in-domain / OOD pass@1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = {
    "cpu": ("configs/cpu/default.yaml", ["task.eval_size=8", "eval.k=1"]),
    "smollm2": ("configs/cpu/smollm2-135m.yaml", ["task.eval_size=4", "eval.k=1", "eval.max_new_tokens=8"]),
}
COMMON = ["checkpoint.interval=0", "logging.progress=false", "logging.tensorboard=false"]


def train(config: str, out: Path, overrides: list[str]) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "megatron_kl.cli",
        "train",
        "--config",
        str(ROOT / config),
        f"train.output_dir={out}",
        *COMMON,
        *overrides,
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mismatch(jobs: list[str], tmp: Path) -> None:
    print("== step-0 train-vs-rollout mismatch per response token")
    print(
        f"{'job':8s} {'rollouts':9s} {'|log mu - log pi_old| mean':>27s} {'max':>8s} {'KL(mu||pi_old) k1':>18s} "
        f"{'k3':>10s}"
    )
    for job in jobs:
        config, extra = JOBS[job]
        for quantization in ("none", "fp8"):
            records = train(
                config,
                tmp / f"mismatch-{job}-{quantization}",
                [*extra, "train.steps=1", f"rollout.quantization={quantization}"],
            )
            step0 = next(r for r in records if r.get("step") == 0 and "mismatch/abs_logprob_mean" in r)
            print(
                f"{job:8s} {quantization:9s} {step0['mismatch/abs_logprob_mean']:27.3e} "
                f"{step0['mismatch/abs_logprob_max']:8.3e} {step0['mismatch/k1_token']:18.3e} "
                f"{step0['mismatch/k3_token']:10.3e}",
                flush=True,
            )


ARMS = (
    ("unquantized", ["rollout.quantization=none"]),
    ("fp8, no correction", ["rollout.quantization=fp8", "algo.behavior_correction=none"]),
    ("fp8, token TIS", ["rollout.quantization=fp8", "algo.behavior_correction=token_tis"]),
)


def training(job: str, seeds: list[int], steps: int, tmp: Path) -> None:
    print(f"\n== the {job} job, {steps} steps per seed (seeds {' '.join(map(str, seeds))}), arms interleaved")
    print(
        f"{'arm':20s} {'seed':>5s} {'mean |log mu - log pi_old|':>27s} {'exact KL to ref (last)':>23s} "
        f"{'pass@1 in-domain':>17s} {'OOD':>6s}"
    )
    summary: dict[str, list] = {name: [] for name, _ in ARMS}
    for seed in seeds:
        for arm, (name, overrides) in enumerate(ARMS):
            records = train(
                JOBS[job][0],
                tmp / f"train-{job}-{seed}-arm{arm}",
                [f"train.steps={steps}", f"train.seed={seed}", *overrides],
            )
            steps_ = [r for r in records if "mismatch/abs_logprob_mean" in r]
            gap = statistics.mean(r["mismatch/abs_logprob_mean"] for r in steps_)
            exact = [r["kl/exact_token"] for r in steps_ if "kl/exact_token" in r][-1]
            final = [r for r in records if "eval/id/pass@1" in r][-1]
            row = (gap, exact, final["eval/id/pass@1"], final["eval/ood/pass@1"])
            summary[name].append(row)
            print(f"{name:20s} {seed:5d} {row[0]:27.3e} {row[1]:23.4f} {row[2]:17.3f} {row[3]:6.3f}", flush=True)
    print("\nmeans over seeds:")
    for name, rows in summary.items():
        means = [statistics.mean(column) for column in zip(*rows)]
        print(f"{name:20s} {'':5s} {means[0]:27.3e} {means[1]:23.4f} {means[2]:17.3f} {means[3]:6.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mismatch", default="cpu,smollm2", help="jobs for the step-0 mismatch (comma-separated)")
    parser.add_argument("--train-job", choices=sorted(JOBS), default="cpu", help="the job of the training arms")
    parser.add_argument("--train-seeds", type=int, nargs="*", default=[1234, 1])
    parser.add_argument("--train-steps", type=int, default=60)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.mismatch:
            mismatch([j for j in args.mismatch.split(",") if j], Path(tmp))
        if args.train_seeds:
            training(args.train_job, args.train_seeds, args.train_steps, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
