"""Partial rollouts against waiting for the generation in flight, at one staleness bound, on a heavy-tailed rollout.

    python tools/bench_partial_rollouts.py [--steps 10] [--repeats 2] [--staleness 2] [--token-latency-s 0.1]
                                           [--long-every 8] [--max-new-tokens 24]

Each run is the CPU job (configs/cpu/default.yaml, from its shipped warm start) on SGLang servers - the test server
(megatron_kl.testing.sglang_server: SGLang's HTTP API on the embedded engine) with ``--token-latency-s`` (every token
takes that long to come out, requests overlapping as under continuous batching) and ``--long-every`` (every N-th
request ignores its stop tokens and runs to max_new_tokens: with the task's answers stopping after ~2-3 tokens, a
heavy tail ~10x the median). ``train.staleness`` is the same in both arms; ``rollout.partial`` false (the weight
update waits for the batch in flight: its longest response) or true (the update pauses it; it finishes with the next
weights beside the next batch). The arms alternate, ``--repeats`` times each; every run's steps/s is taken over the
steps after the first two (the queue's warm-up), training time only (evaluation excluded). Printed: each run, then
per arm the min and median steps/s, the median of time/weight_sync (the wait at the update) and the ratio of the
medians, partial over waiting.
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


def run(arm: bool, args, out: Path, port: int) -> dict:
    overrides = [
        f"train.output_dir={out}",
        f"train.steps={args.steps}",
        "train.prompts_per_step=8",
        "train.group_size=4",
        f"train.staleness={args.staleness}",
        f"rollout.partial={'true' if arm else 'false'}",
        "rollout.engine=sglang",
        "rollout.sglang.server_module=megatron_kl.testing.sglang_server",
        f"rollout.sglang.port={port}",
        "rollout.sglang.weight_sync=from_tensor",
        f"rollout.sglang.extra_args=[--token-latency-s, '{args.token_latency_s}', --long-every, '{args.long_every}']",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        "eval.interval=0",
        "task.eval_size=8",
        "eval.k=1",
        "checkpoint.interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "kl.estimator=k3",
        "kl.placement=loss",
        "kl.off_policy=token_is",
    ]
    command = [
        sys.executable,
        "-m",
        "megatron_kl.cli",
        "train",
        "--config",
        str(ROOT / "configs/cpu/default.yaml"),
        *overrides,
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "time/step" in r and r["step"] >= 2]
    seconds = sum(r["time/step"] - r.get("time/eval", 0.0) for r in steps)
    return {
        "partial": arm,
        "steps_per_s": len(steps) / seconds,
        "weight_sync_s": statistics.median(r["time/weight_sync"] for r in steps),
        "rollout_wait_s": statistics.median(r["time/rollout_wait"] for r in steps),
        "mixed": statistics.mean(r["staleness/mixed_response_fraction"] for r in steps),
        "token_max": max(r["staleness/token_max"] for r in steps),
        "response_len": statistics.mean(r["response/length_mean"] for r in steps),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--token-latency-s", type=float, default=0.1)
    parser.add_argument("--long-every", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=31500)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for arm in (False, True):  # interleaved
                result = run(arm, args, Path(tmp) / f"{'partial' if arm else 'wait'}-{repeat}", args.port)
                results.append(result)
                print(
                    f"run {len(results)}: partial={str(arm).lower():5s} {result['steps_per_s']:.3f} steps/s, "
                    f"weight_sync {result['weight_sync_s']:.2f} s, rollout wait {result['rollout_wait_s']:.2f} s, "
                    f"mixed responses {result['mixed']:.3f}, max token staleness {result['token_max']:.0f}, "
                    f"mean response {result['response_len']:.1f} tokens",
                    flush=True,
                )
    print(
        f"\nstaleness {args.staleness}, {args.steps} steps (steps/s over steps 2..{args.steps - 1}), token latency "
        f"{args.token_latency_s:g} s, every {args.long_every}th response to max_new_tokens={args.max_new_tokens}"
    )
    medians = {}
    for arm in (False, True):
        rates = [r["steps_per_s"] for r in results if r["partial"] is arm]
        medians[arm] = statistics.median(rates)
        sync = statistics.median(r["weight_sync_s"] for r in results if r["partial"] is arm)
        print(
            f"rollout.partial={str(arm).lower():5s} steps/s min {min(rates):.3f} median {medians[arm]:.3f}; "
            f"median weight_sync {sync:.2f} s"
        )
    print(f"ratio of medians (partial / waiting): {medians[True] / medians[False]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
