"""Step-time breakdown of the RL trainer on this machine, and the orchestration overhead.

    python tools/bench_step.py [--config configs/cpu/default.yaml] [--steps 12] [overrides ...]
    python tools/bench_step.py --trl-workload 135m [--steps 4] [overrides ...]   # tools/bench_trl.py's workload
    python tools/bench_step.py --moe 4 2 [--rounds 2] [overrides ...]   # MoE vs the dense model, same active size
    python tools/bench_step.py --teacher [--rounds 2] [overrides ...]  # distillation vs the reference-only step

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

``--moe E K``: the config's dense model against its mixture-of-experts twin with the same active parameters
(E experts of width ffn / K, top-K routing: each token's MLP is K x 3 x hidden x ffn / K, the dense MLP's size,
plus the router), alternating dense and MoE runs for ``--rounds`` rounds in one process; prints each model's
median step and phases and the MoE / dense ratio (min and median over the rounds' medians).

``--teacher``: the config's step (its KL to the reference) against the same step distilling from a teacher of twice
the student's depth (about twice its parameters: the same width, 2 x model.num_layers), the exact KL to the teacher
in the loss (distill.kl defaults) and the reference term sampled (k3), alternating the two for ``--rounds`` rounds in
one process; prints each one's median step and phases (the teacher pass under ``teacher``) and the ratio (min and
median over the rounds' medians).

The floor: the work a step cannot avoid, at this machine's rates measured in the same run - the reference
forward and the policy forward + backward over the batch's real tokens (2 + 6 FLOPs per parameter and token,
output projection included, plus attention) at the GEMM rate measured in the model's dtype
(``model.params_dtype``: float32, or bfloat16 where this CPU has bf16 dot-product instructions), and decoding:
every new token position reads the weights once (memory-bound at these batch sizes) at the measured memory
bandwidth, or its FLOPs at the GEMM rate when that is slower. The step is printed as a multiple of the floor; the padded
tokens (the batch as the passes see it) and the old-log-prob pass are what the floor leaves out.

Where the rest goes: one more step runs under ``torch.profiler`` (``logging.profile_steps``, left out of the
medians; ``--no-profile`` skips it) and the self time of its GEMM ops (train/profiling.GEMM_OPS) is printed per
phase, with the GEMMs alone as a multiple of the floor: the part of the step that is matrix products at the
shapes the step runs (decode at a few rows, the backward's transposed operands) rather than at the floor's rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gemm_rate(rows: int, hidden: int, ffn: int, dtype: str = "float32", repeats: int = 20) -> float:
    """Best FLOP/s of [rows, hidden] x [hidden, ffn] in ``dtype`` on this machine (the best of ``repeats``: a
    floor taken from a transiently slow machine would flatter the step - 5 repeats once measured half the rate)."""
    import time

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the trainer runs its model
    a = torch.randn(rows, hidden).to(device, getattr(torch, dtype))
    b = torch.randn(hidden, ffn).to(device, getattr(torch, dtype))
    best = float("inf")
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * rows * hidden * ffn / best


def memory_bandwidth(nbytes: int = 1 << 29, repeats: int = 10) -> float:
    """Best bytes/s of one read pass over a buffer larger than the caches."""
    import time

    import torch

    x = torch.ones(nbytes // 4, device="cuda" if torch.cuda.is_available() else "cpu")
    best = float("inf")
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        x.sum()
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def best_rates(rows: int, hidden: int, ffn: int, dtype: str, rounds: int = 3, pause_s: float = 1.0) -> tuple:
    """(GEMM FLOP/s, memory bytes/s): the best of ``rounds`` measurements ``pause_s`` apart, so that a noisy
    neighbour's burst does not lower the floor."""
    import time

    rates, bandwidths = [], []
    for i in range(rounds):
        if i:
            time.sleep(pause_s)
        rates.append(gemm_rate(rows, hidden, ffn, dtype))
        bandwidths.append(memory_bandwidth())
    return max(rates), max(bandwidths)


def model_shape(model) -> dict:
    """Parameters of the matmuls per token (layers + output projection) and attention FLOPs per token pair."""
    m = model.resolved()
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    layer = m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size
    return {
        "matmul_params": m.num_layers * layer + m.hidden_size * m.vocab_size,
        "attention_flops_per_pair": 4 * m.num_layers * q,
        "hidden": m.hidden_size,
        "ffn": m.ffn_hidden_size,
    }


def step_floor(
    model, records: list[dict], samples: int, new_tokens: int, rate: float, bandwidth: float, bytes_per_param: int = 4
) -> dict:
    """Seconds of the unavoidable work of a median step (docstring); ``records`` give its token counts."""
    import statistics

    shape = model_shape(model)
    tokens = statistics.median(r["batch/tokens"] for r in records)
    per_sequence = tokens / samples
    forward = 2 * shape["matmul_params"] * tokens + shape["attention_flops_per_pair"] * tokens * per_sequence / 2
    training = (1 + 3) * forward / rate  # reference forward; policy forward + backward
    decode_flops = 2 * shape["matmul_params"] * samples * new_tokens
    decode = max(new_tokens * bytes_per_param * shape["matmul_params"] / bandwidth, decode_flops / rate)
    return {
        "training": training,
        "decode": decode,
        "total": training + decode,
        "tokens": tokens,
        "padded_tokens": statistics.median(r["batch/padded_tokens"] for r in records),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu" / "default.yaml"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--trl-workload",
        choices=["tiny", "135m"],
        help="tools/bench_trl.py's megatron-kl workload of this shape (built in a temporary directory)",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the extra profiled step (GEMM time per phase)")
    parser.add_argument(
        "--moe",
        nargs=2,
        type=int,
        metavar=("EXPERTS", "TOPK"),
        help="compare with the mixture-of-experts twin of the same active parameters",
    )
    parser.add_argument(
        "--teacher",
        action="store_true",
        help="compare with the same step distilling from a teacher of twice the student's depth",
    )
    parser.add_argument("--rounds", type=int, default=2, help="--moe / --teacher: rounds of the two (alternating)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.moe:
        return compare_moe(args)
    if args.teacher:
        return compare_teacher(args)
    if args.trl_workload:
        sys.path.insert(0, str(ROOT / "tools"))
        import bench_trl

        work = Path(tempfile.mkdtemp(prefix="bench-step-"))
        import atexit
        import shutil

        atexit.register(shutil.rmtree, work, ignore_errors=True)
        bench_trl.build_workload(work, [args.trl_workload])
        config, overrides = bench_trl.megatron_kl_config(work, args.trl_workload, new_tokens=32)
        args.config, args.overrides = str(config), [*overrides, *args.overrides]

    _quiet()
    profiled = None if args.no_profile else args.steps  # one more step, profiled, outside the medians
    cfg, records, summary = _run(args.config, args.overrides, args.steps, profiled)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in records)

    step = median("time/step")
    phases = {
        "rollout": median("time/rollout_wait"),
        "reference": median("time/reference"),
        "old_logprobs": median("time/old_logprobs"),
        "update": median("time/update"),
        "weight_sync": median("time/weight_sync"),
    }
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
    shape = model_shape(cfg.model)
    dtype = cfg.model.params_dtype
    rate, bandwidth = best_rates(int(median("batch/tokens")), shape["hidden"], shape["ffn"], dtype)
    floor = step_floor(
        cfg.model,
        records,
        cfg.train.prompts_per_step * cfg.train.group_size,
        cfg.rollout.sampling.max_new_tokens,
        rate,
        bandwidth,
        4 if dtype == "float32" else 2,
    )
    print(
        f"floor: {dtype} GEMM {rate / 1e9:.1f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s, "
        f"{floor['tokens']:.0f} real tokens ({floor['padded_tokens']:.0f} padded) per step"
    )
    print(f"{'floor train':<16}{floor['training']:>10.4f}   reference fwd + policy fwd/bwd, real tokens")
    print(f"{'floor decode':<16}{floor['decode']:>10.4f}   weights read once per new-token position")
    print(
        f"{'floor':<16}{floor['total']:>10.4f}   step = {step / floor['total']:.2f}x the floor "
        f"(update = {phases['update'] / (0.75 * floor['training']):.2f}x its part, rollout = "
        f"{phases['rollout'] / floor['decode']:.2f}x)"
    )
    if summary is not None:
        print_gemm_split(summary, floor["total"])
    return 0 if overhead / step < 0.10 else 1


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)


def _run(config: str, overrides: list[str], steps: int, profiled: Optional[int] = None):
    """The trainer in-process for ``steps`` steps (no evaluation or checkpoints), plus step ``profiled`` under
    the profiler when given: (the config, the records of the steps after the first and other than the profiled
    one, the profiled step's summary or None)."""
    from megatron_kl.models import parallel
    from megatron_kl.train.cli import single_process_env
    from megatron_kl.train.config import load_train_config
    from megatron_kl.train.loop import train
    from megatron_kl.train.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_train_config(
            config,
            [
                f"train.steps={steps + (profiled is not None)}",
                f"train.output_dir={tmp}/run",
                "eval.interval=0",
                "checkpoint.interval=0",
                "logging.progress=false",
                "logging.tensorboard=false",
                *([f"logging.profile_steps=[{profiled}]"] if profiled is not None else []),
                *overrides,
            ],
        )
        single_process_env()
        try:
            train(cfg)
        finally:
            parallel.destroy()
        records = [r for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if "time/step" in r]
        records = [r for r in records if r["step"] != profiled][1:]
        summary = (
            json.loads((Path(tmp) / "run" / "profile" / f"step_{profiled}.rank0.summary.json").read_text())
            if profiled is not None
            else None
        )
    return cfg, records, summary


def compare_moe(args) -> int:
    _quiet()
    from megatron_kl.train.config import load_train_config

    experts, topk = args.moe
    model = load_train_config(args.config, list(args.overrides)).model
    if model.ffn_hidden_size % topk:
        raise SystemExit(f"--moe: model.ffn_hidden_size={model.ffn_hidden_size} is not divisible by top-k {topk}")
    twin = [
        f"model.moe.num_experts={experts}",
        f"model.moe.router_topk={topk}",
        f"model.moe.ffn_hidden_size={model.ffn_hidden_size // topk}",
    ]
    keys = ("time/step", "time/rollout_wait", "time/reference", "time/old_logprobs", "time/update")
    medians = {"dense": [], "moe": []}
    for _ in range(args.rounds):
        for name, extra in (("dense", []), ("moe", twin)):
            records = _run(args.config, [*args.overrides, *extra], args.steps)[1]
            medians[name].append({k: statistics.median(r[k] for r in records) for k in keys})
    print(
        f"config {args.config} {' '.join(args.overrides)}; MoE twin: {' '.join(twin)}; {args.rounds} rounds x "
        f"{args.steps} steps (first excluded), alternating"
    )
    print(f"{'phase':<16}{'dense s':>10}{'MoE s':>10}{'min x':>9}{'median x':>10}")
    for key in keys:
        ratios = [m[key] / d[key] for d, m in zip(medians["dense"], medians["moe"])]
        dense = statistics.median(d[key] for d in medians["dense"])
        moe = statistics.median(m[key] for m in medians["moe"])
        print(f"{key.split('/')[1]:<16}{dense:>10.4f}{moe:>10.4f}{min(ratios):>9.2f}{statistics.median(ratios):>10.2f}")
    return 0


def compare_teacher(args) -> int:
    _quiet()
    from megatron_kl.config import to_dict
    from megatron_kl.train.config import load_train_config

    model = load_train_config(args.config, list(args.overrides)).model
    teacher = {**to_dict(model), "num_layers": 2 * model.num_layers}
    with tempfile.TemporaryDirectory() as cache:
        distill = [
            "distill.enabled=true",
            "kl.estimator=k3",
            "distill.teacher.source=warm_start",
            "distill.teacher.warm_start_steps=1",
            f"warm_start.cache_dir={cache}",
            *(
                f"distill.teacher.model.{k}={v}"
                for k, v in teacher.items()
                if not isinstance(v, dict) and v is not None
            ),
        ]
        keys = ("time/step", "time/rollout_wait", "time/reference", "time/teacher", "time/old_logprobs", "time/update")
        medians = {"reference": [], "teacher": []}
        for _ in range(args.rounds):
            for name, extra in (("reference", []), ("teacher", distill)):
                records = _run(args.config, [*args.overrides, *extra], args.steps)[1]
                medians[name].append({k: statistics.median(r.get(k, 0.0) for r in records) for k in keys})
    print(
        f"config {args.config} {' '.join(args.overrides)}; teacher: {teacher['num_layers']} layers x hidden "
        f"{teacher['hidden_size']} (student {model.num_layers} x {model.hidden_size}), distill.kl defaults, kl.estimator"
        f"=k3; {args.rounds} rounds x {args.steps} steps (first excluded), alternating"
    )
    print(f"{'phase':<16}{'reference s':>12}{'teacher s':>11}{'min x':>9}{'median x':>10}")
    for key in keys:
        ratios = [t[key] / r[key] for r, t in zip(medians["reference"], medians["teacher"]) if r[key] > 0]
        ref = statistics.median(r[key] for r in medians["reference"])
        tea = statistics.median(t[key] for t in medians["teacher"])
        shown = f"{min(ratios):>9.2f}{statistics.median(ratios):>10.2f}" if ratios else f"{'-':>9}{'-':>10}"
        print(f"{key.split('/')[1]:<16}{ref:>12.4f}{tea:>11.4f}{shown}")
    return 0


def print_gemm_split(summary: dict, floor_s: float) -> None:
    """The profiled step's GEMM self time per phase (train/profiling.summarize) and the GEMMs alone against the
    floor."""
    print(f"profiled step (not in the medians; the profiler slows the other ops): {summary['step_s']:.4f} s")
    print(f"{'phase':<16}{'GEMM s':>10}{'other ops s':>13}{'ops':>9}")
    for name, row in summary["phases"].items():
        if row["ops"]:
            print(f"{name:<16}{row['gemm_s']:>10.4f}{row['ops_s'] - row['gemm_s']:>13.4f}{row['ops']:>9d}")
    print(f"{'GEMM alone':<16}{summary['gemm_s']:>10.4f}   = {summary['gemm_s'] / floor_s:.2f}x the floor")


if __name__ == "__main__":
    sys.exit(main())
