"""Step-time breakdown of the RL trainer on this machine, and the orchestration overhead.

    python tools/bench_step.py [--config configs/cpu/default.yaml] [--steps 12] [overrides ...]

Runs the trainer in-process (one rank) for ``--steps`` steps without evaluation or checkpoints, and
reports the median of each timed phase as a share of the median step:

  rollout          generation by the embedded engine (KV cache)
  reference        forward of the frozen reference (log-probs + hidden states for the exact KL)
  old_logprobs     forward of the policy (log-probs, entropies, exact KL)
  update           forward/backward/optimizer steps of the PPO epochs
  weight_sync      copying the policy weights into the engine
  orchestration    everything else: batching, rewards, advantages, metrics, logging

The baseline is the step itself, measured in the same run: orchestration = step - (rollout + reference +
old_logprobs + update); the target is < 10 % of the step. The first step (warm-up) is excluded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu" / "default.yaml"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.basicConfig(level=logging.WARNING)
    from megatron_kl.models import parallel
    from megatron_kl.train.cli import _single_process_env
    from megatron_kl.train.config import load_train_config
    from megatron_kl.train.loop import train
    from megatron_kl.train.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_train_config(args.config, [
            f"train.steps={args.steps}", f"train.output_dir={tmp}/run", "eval.interval=0", "checkpoint.interval=0",
            "logging.progress=false", "logging.tensorboard=false", *args.overrides,
        ])
        _single_process_env()
        try:
            train(cfg)
        finally:
            parallel.destroy()
        records = [r for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if "time/step" in r][1:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in records)

    step = median("time/step")
    phases = {"rollout": median("time/rollout_wait"), "reference": median("time/reference"),
              "old_logprobs": median("time/old_logprobs"), "update": median("time/update"),
              "weight_sync": median("time/weight_sync")}
    overhead = statistics.median(
        r["time/step"] - r["time/rollout_wait"] - r["time/reference"] - r["time/old_logprobs"] - r["time/update"]
        for r in records
    )
    print(f"config {args.config} {' '.join(args.overrides)}; {len(records)} measured steps (first excluded)")
    print(f"{'phase':<16}{'median s':>10}{'of step':>10}")
    for name, seconds in phases.items():
        print(f"{name:<16}{seconds:>10.4f}{seconds / step:>10.1%}")
    print(f"{'orchestration':<16}{overhead:>10.4f}{overhead / step:>10.1%}   (target < 10%; includes weight_sync)")
    print(f"{'step':<16}{step:>10.4f}{1:>10.1%}   tokens/s {median('throughput/tokens_per_s'):.0f}")
    return 0 if overhead / step < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
