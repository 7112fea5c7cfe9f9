"""Delta weight sync against full syncs on a real model: bytes sent and seconds per sync.

    python tools/bench_delta_sync.py [--config configs/cpu/smollm2-135m.yaml] [--lrs 1e-6 1e-5] [--steps 3]
                                     [--engine sglang|vllm]

Each run is the job in ``--config`` (default SmolLM2-135M-Instruct in bf16; prepare it as that file says) for
``--steps`` RL steps (16 new tokens a response: the syncs are what is measured) on the SGLang test server with
``weight_sync=from_tensor`` (``--engine sglang``) or on vLLM's in-process engine (``--engine vllm``: run it with
the vLLM environment's python, ``.venv-vllm/bin/python``; the trainer's engine core runs in a child process, so each
sync travels as a file), at each learning rate, with
``rollout.delta_sync`` false and true (interleaved). Printed per run and step: the sync's bytes
(``weight_sync/bytes``), a full sync's (``weight_sync/bytes_full``), the changed share of the elements, and the wall
time of the step's weight sync (``time/weight_sync``: pausing, sending, the server loading, resuming); then per
learning rate the medians, delta over full.
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


ENGINES = {
    "sglang": [
        "rollout.engine=sglang",
        "rollout.sglang.server_module=megatron_kl.testing.sglang_server",
        "rollout.sglang.weight_sync=from_tensor",
    ],
    "vllm": ["rollout.engine=vllm", "rollout.vllm.dtype=bfloat16"],
}


def run(config: str, lr: float, delta: bool, steps: int, out: Path, port: int, engine: str) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "megatron_kl.cli",
        "train",
        "--config",
        str(ROOT / config),
        f"train.output_dir={out}",
        f"train.steps={steps}",
        f"optim.lr={lr}",
        *ENGINES[engine],
        f"rollout.sglang.port={port}",
        f"rollout.delta_sync={'true' if delta else 'false'}",
        "rollout.sampling.max_new_tokens=16",
        "eval.interval=0",
        "task.eval_size=4",
        "eval.k=1",
        "eval.max_new_tokens=4",
        "checkpoint.interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "weight_sync/bytes" in r]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu/smollm2-135m.yaml")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--port", type=int, default=31700)
    parser.add_argument("--engine", choices=sorted(ENGINES), default="sglang")
    args = parser.parse_args(argv)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lrs:
            for delta in (False, True):
                steps = run(args.config, lr, delta, args.steps, Path(tmp) / f"lr{lr:g}-{delta}", args.port, args.engine)
                results[(lr, delta)] = steps
                for r in steps:
                    print(
                        f"lr {lr:g} delta_sync={str(delta).lower():5s} step {r['step']}: "
                        f"{r['weight_sync/bytes'] / 1e6:8.2f} MB of {r['weight_sync/bytes_full'] / 1e6:.2f} MB, "
                        f"changed elements {r['weight_sync/changed_elements']:.4f}, changed tensors "
                        f"{r['weight_sync/changed_tensors']:.3f}, weight sync {r['time/weight_sync']:.2f} s",
                        flush=True,
                    )
    print()
    for lr in args.lrs:
        full, delta = results[(lr, False)], results[(lr, True)]
        mb = [statistics.median(r["weight_sync/bytes"] for r in arm) / 1e6 for arm in (full, delta)]
        seconds = [statistics.median(r["time/weight_sync"] for r in arm) for arm in (full, delta)]
        changed = statistics.median(r["weight_sync/changed_elements"] for r in delta)
        print(
            f"lr {lr:g}: median per sync - full {mb[0]:.2f} MB {seconds[0]:.2f} s, delta {mb[1]:.2f} MB "
            f"{seconds[1]:.2f} s ({mb[1] / mb[0]:.3f}x the bytes, {seconds[1] / seconds[0]:.2f}x the time); "
            f"changed elements {changed:.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
