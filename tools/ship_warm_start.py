"""Train a recipe's supervised warm start once and ship it with the package (megatron_kl/data/warm_starts/).

Every machine then starts the recipe's RL runs from these bytes (``warm_start.source=auto``), whatever its CPU's
float32 rounding would have trained. The weights are trained here, on one rank, by the trainer's own warm-start
code (``warm_start.source=train``: never from a cache or an earlier shipped file).

    python tools/ship_warm_start.py --config configs/cpu/default.yaml

Changing a model, task or warm-start field the recipe key covers (``train.warmstart.recipe_key``) needs a new
file: tests/unit/test_shipped_warm_start.py fails until it is made.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _train(rank: int, world_size: int, config: str, overrides: list[str], cache_dir: str):
    """The trainer's own warm start (``warm_start_state``), forced to train into an empty cache."""
    from megatron_kl.models import parallel
    from megatron_kl.tasks import build_task
    from megatron_kl.train import warmstart
    from megatron_kl.train.config import load_train_config

    cfg = load_train_config(config, overrides + ["warm_start.source=train", f"warm_start.cache_dir={cache_dir}"])
    parallel.initialize(cfg.model, cfg.parallel, seed=cfg.train.seed)
    return warmstart.warm_start_state(cfg, build_task(cfg.task))


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--config", required=True)
    args.add_argument("overrides", nargs="*")
    ns = args.parse_args(argv)

    from megatron_kl.local_ranks import run_ranks
    from megatron_kl.train import shipped_warmstart, warmstart
    from megatron_kl.train.config import load_train_config

    cfg = load_train_config(ns.config, ns.overrides)
    if cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel != 1:
        print(
            "ship_warm_start: train it with parallel.tensor_parallel=1 and parallel.pipeline_parallel=1 "
            "(the state is layout-independent)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as cache_dir:
        state = run_ranks(_train, 1, ns.config, ns.overrides, cache_dir, timeout_s=3600)[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    made_with = " ".join([ns.config, *ns.overrides]) + f" at {commit.strip() or 'an unknown commit'}"
    entry = shipped_warmstart.write(state, warmstart.recipe_key(cfg), made_with)
    print(f"{entry.path.relative_to(ROOT)}: file {entry.sha256[:16]}, weights {entry.weights_sha256[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
