"""Benchmark: vocab-parallel log-probs / entropy / exact KL against megatron-core's own kernel.

Sections, each against baselines measured in the same run:

* ``logits`` (input: the vocab-sharded logits, fp32, forward + backward), at TP=1 and TP=2 (gloo ranks):
  megatron-core's ``vocab_parallel_cross_entropy`` (the baseline: log-probs = -loss) vs
  ``megatron_kl.vocab_parallel.stats`` for log-probs, log-probs + entropy and the exact KL(pi || pi_ref)
  (policy and reference logits), plus naive fp32 autograd at TP=1. Every path gets a fresh copy of the
  logits (megatron-core overwrites its input; ours runs with ``inplace_backward``, the training setting,
  and once without it). Implementations are interleaved round by round in one process group; the time
  of a run is the slowest rank's; min and median of ``--repeats`` rounds after one warm-up round.
  Peak extra memory (TP=1) is measured per implementation in a fresh subprocess (glibc told to serve
  large blocks by mmap so RSS follows live memory) as peak RSS minus the RSS with the inputs allocated,
  in units of one fp32 logits tensor.
* ``chunks``: ours at TP=1 with chunks of 2^18 .. 2^24 entries, interleaved (the automatic chunk rule).
* ``truncation`` (logits in, fp32, fwd+bwd, TP=1 and TP=2): log-prob + entropy + exact KL of the full
  softmax (the baseline) vs the same of the top-k / top-p truncated distribution (support found over the shards,
  ``vocab_parallel.truncation``), on logits of two shapes: ``--logit-scale`` (default 2: flat, supports of thousands of
  tokens at top-p 0.9) and 6 (peaked, as a trained LM's). Memory at TP=1 as in ``logits``. Then the same
  rules on the fused-linear path (hidden states and output weight in, ``--hidden``, a quarter of the tokens) at
  TP=1 against its full softmax.
* ``linear`` (input: hidden states + output weight, the projection included, gradients w.r.t. both):
  naive (full logits, log_softmax) vs unfused (full logits, then fused_stats in place) vs fused linear
  (recompute in backward) vs the fused single pass (model.fused_grad=in_forward), interleaved.

    python tools/bench_vocab_parallel.py                                  # logits + chunks, 4096 x 32768
    python tools/bench_vocab_parallel.py --section linear --sizes 2048x152064 --hidden 896
    python tools/bench_vocab_parallel.py --section truncation --sizes 4096x32768
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package and tools.bench_cpu_paths / bench_gpu_paths

from tools.bench_cpu_paths import (  # noqa: E402 - after the path
    TRUNCATIONS,
    linear_paths_cpu,
    logits_paths_cpu,
    truncation_linear_paths,
    truncation_paths,
)

LOGITS_IMPLS = (
    "megatron_core_logprobs",
    "logprobs",
    "logprobs_no_inplace",
    "logprobs_entropy",
    "exact_kl",
    "naive_logprobs",
    "naive_logprobs_entropy",
    "naive_exact_kl",
)
LINEAR_IMPLS = ("naive", "unfused", "fused_linear", "fused_single_pass")
LOGIT_SCALES = (2.0, 6.0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _interleaved(paths: dict, repeats: int, group=None) -> dict:
    """Each round runs every path once, in order; returns name -> list of times (slowest rank)."""
    import torch
    import torch.distributed as dist

    times = {name: [] for name in paths}
    for round_index in range(repeats + 1):  # round 0: warm-up
        for name, prepare in paths.items():
            run = prepare()
            if group is not None:
                dist.barrier(group=group)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            if group is not None:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            del run
            if round_index:
                times[name].append(elapsed.item())
    return times


def _tp_worker(rank: int, world: int, tokens: int, vocab: int, repeats: int, chunk, scale=None) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_kl.megatron_compat import apply_cpu_shims

    apply_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    try:
        if scale is not None:
            return _interleaved(truncation_paths(tokens, vocab, chunk, group, world, rank, scale), repeats, group)
        return _interleaved(logits_paths_cpu(tokens, vocab, chunk, group, world, rank), repeats, group)
    finally:
        parallel_state.destroy_model_parallel()
        dist.barrier()


def _child_memory(section: str, impl: str, size: str, hidden: int, chunk: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        f"{section}:{impl}",
        "--sizes",
        size,
        "--hidden",
        str(hidden),
        "--chunk",
        str(chunk),
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_memory(section: str, impl: str, size: str, hidden: int, chunk) -> dict:
    """One warm-up and one measured run of ``impl`` in this (fresh) process: peak extra bytes."""
    import warnings

    warnings.filterwarnings("ignore")
    tokens, vocab = map(int, size.split("x"))
    if section.startswith("truncation") or section == "logits":
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state

        from megatron_kl.megatron_compat import apply_cpu_shims

        apply_cpu_shims()
        parallel_state.initialize_model_parallel(1)
        group = parallel_state.get_tensor_model_parallel_group()
        if section == "logits":
            paths = logits_paths_cpu(tokens, vocab, chunk, group, 1, 0)
        else:  # truncation@<scale>
            paths = truncation_paths(tokens, vocab, chunk, group, 1, 0, float(section.split("@")[1]))
    else:
        paths = linear_paths_cpu(tokens, vocab, hidden, chunk)
    prepare = paths[impl]
    prepare()()  # warm-up
    run = prepare()  # the fresh input copy is made here, before the baseline
    baseline = _rss_bytes()
    run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_extra_bytes": max(0, peak - baseline)}


def _row(name: str, times: list, base: list, memory=None, unit_bytes=None) -> str:
    mem = "" if memory is None else f" {memory / 2**20:10.1f} {memory / unit_bytes:8.2f}"
    return (
        f"{name:>26s} {min(times):8.3f} {statistics.median(times):8.3f} "
        f"{min(times) / min(base):9.2f} {statistics.median(times) / statistics.median(base):9.2f}{mem}"
    )


def run_logits(args) -> None:
    from megatron_kl.local_ranks import run_ranks

    for size in args.sizes.split(","):
        tokens, vocab = map(int, size.split("x"))
        unit = tokens * vocab * 4
        memory = {
            impl: _child_memory("logits", impl, size, args.hidden, args.chunk)["peak_extra_bytes"]
            for impl in LOGITS_IMPLS
        }
        for world in (1, 2):
            per_rank = run_ranks(
                _tp_worker,
                world,
                tokens,
                vocab,
                args.repeats,
                args.chunk or None,
                timeout_s=3600,
                threads_per_rank=max(1, (os.cpu_count() or 2) // world),
            )
            times = per_rank[0]
            base = times["megatron_core_logprobs"]
            print(
                f"\nlogits in, fp32, fwd+bwd, TP={world} ({size}, {args.repeats} rounds; ratios vs "
                f"megatron-core vocab_parallel_cross_entropy; memory at TP=1 in fp32-logits units)"
            )
            print(
                f"{'impl':>26s} {'min s':>8s} {'median s':>8s} {'min x':>9s} {'median x':>9s}"
                + (f" {'peak MiB':>10s} {'x logits':>8s}" if world == 1 else "")
            )
            for name, values in times.items():
                print(_row(name, values, base, memory[name] if world == 1 else None, unit))


def run_truncation(args) -> None:
    from megatron_kl.local_ranks import run_ranks

    for size in args.sizes.split(","):
        tokens, vocab = map(int, size.split("x"))
        unit = tokens * vocab * 4
        for scale in LOGIT_SCALES:
            memory = {
                impl: _child_memory(f"truncation@{scale}", impl, size, args.hidden, args.chunk)["peak_extra_bytes"]
                for impl in TRUNCATIONS
            }
            for world in (1, 2):
                times = run_ranks(
                    _tp_worker,
                    world,
                    tokens,
                    vocab,
                    args.repeats,
                    args.chunk or None,
                    scale,
                    timeout_s=3600,
                    threads_per_rank=max(1, (os.cpu_count() or 2) // world),
                )[0]
                print(
                    f"\nlogits in (scale {scale} x randn), fp32, log-prob + entropy + exact KL fwd+bwd in place, TP={world} "
                    f"({size}, {args.repeats} rounds; ratios vs the full softmax; memory at TP=1 in fp32-logits units)"
                )
                print(
                    f"{'impl':>26s} {'min s':>8s} {'median s':>8s} {'min x':>9s} {'median x':>9s}"
                    + (f" {'peak MiB':>10s} {'x logits':>8s}" if world == 1 else "")
                )
                for name, values in times.items():
                    print(_row(name, values, times["full_stats"], memory[name] if world == 1 else None, unit))
            linear_tokens = max(1, tokens // 4)  # the projection dominates: a quarter of the rows keeps it short
            times = _interleaved(
                truncation_linear_paths(linear_tokens, vocab, args.hidden, scale, args.chunk or None), args.repeats
            )
            print(
                f"\nhidden in (H={args.hidden}, logits ~ {scale} x randn), fp32, fused linear: projection + log-prob + "
                f"entropy + exact KL, grads w.r.t. hidden and weight, TP=1 ({linear_tokens}x{vocab}, "
                f"{args.repeats} rounds; ratios vs the full softmax)"
            )
            print(f"{'impl':>26s} {'min s':>8s} {'median s':>8s} {'min x':>9s} {'median x':>9s}")
            for name, values in times.items():
                print(_row(name, values, times["full_stats"]))


def run_chunks(args) -> None:
    from megatron_kl.local_ranks import run_ranks

    tokens, vocab = map(int, args.sizes.split(",")[0].split("x"))
    elements = [1 << k for k in range(18, 25, 1)]
    results = {}
    for impl in ("logprobs", "logprobs_entropy", "exact_kl"):
        per_chunk = run_ranks(
            _chunk_worker,
            1,
            tokens,
            vocab,
            args.repeats,
            impl,
            elements,
            timeout_s=3600,
            threads_per_rank=os.cpu_count() or 2,
        )[0]
        results[impl] = per_chunk
    print(f"\nchunk sweep, TP=1, {tokens}x{vocab} fp32, fwd+bwd in place (min of {args.repeats}, seconds)")
    print(f"{'entries/chunk':>14s} {'rows':>6s} " + " ".join(f"{k:>17s}" for k in results))
    for e in elements:
        print(f"{e:>14d} {max(1, e // vocab):>6d} " + " ".join(f"{min(results[k][e]):17.3f}" for k in results))


def _chunk_worker(rank, world, tokens, vocab, repeats, impl, elements):
    paths = {}
    for e in elements:
        paths[e] = logits_paths_cpu(tokens, vocab, max(1, e // vocab), None, 1, 0)[impl]
    return _interleaved(paths, repeats)


def run_linear(args) -> None:
    for size in args.sizes.split(","):
        tokens, vocab = map(int, size.split("x"))
        memory = {
            impl: _child_memory("linear", impl, size, args.hidden, args.chunk)["peak_extra_bytes"]
            for impl in LINEAR_IMPLS
        }
        times = _interleaved(linear_paths_cpu(tokens, vocab, args.hidden, args.chunk or None), args.repeats)
        unit = tokens * vocab * 4
        print(
            f"\nhidden in (H={args.hidden}), fp32: projection + log-prob + entropy + exact KL, grads w.r.t. hidden "
            f"and weight ({size}, {args.repeats} rounds; ratios vs unfused; memory in fp32-logits units)"
        )
        print(
            f"{'impl':>26s} {'min s':>8s} {'median s':>8s} {'min x':>9s} {'median x':>9s} {'peak MiB':>10s} "
            f"{'x logits':>8s}"
        )
        for name, values in times.items():
            print(_row(name, values, times["unfused"], memory[name], unit))


def _gpu_memory(prepare) -> int:
    """Peak extra CUDA memory of one run of ``prepare()()`` over what is allocated before it (inputs included)."""
    import torch

    prepare()()  # warm-up
    run = prepare()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - baseline)


def _gpu_inputs(tokens: int, vocab: int, dtype, hidden_size: int = 0, scale: float = 2.0, device: str = "cuda"):
    """Logits (policy, reference near it, targets) or hidden states + weights, made on ``device`` in ``dtype``."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    if hidden_size:
        hidden = torch.randn(tokens, hidden_size, generator=g, device=device).to(dtype)
        weight = scale * torch.randn(vocab, hidden_size, generator=g, device=device) / hidden_size**0.5
        reference_weight = (
            weight + 0.05 * torch.randn(vocab, hidden_size, generator=g, device=device) / hidden_size**0.5
        )
        targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
        return hidden, weight.to(dtype), reference_weight.to(dtype), targets
    logits = scale * torch.randn(tokens, vocab, generator=g, device=device)
    reference = (logits + 0.05 * torch.randn(tokens, vocab, generator=g, device=device)).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    return logits.to(dtype), reference, targets


def run_gpu(args, section: str) -> None:
    """``--device cuda``: one GPU, TP=1, in this process; CUDA-synchronised wall times, peak CUDA memory, and for
    logits in the share of a device-to-device copy's bandwidth each statistic's floor bytes reach
    (``tools/bench_gpu_paths.py``)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tools.bench_gpu_paths import linear_paths, logits_paths

    device = "cpu" if args.dry_run else "cuda"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo" if args.dry_run else "nccl", rank=0, world_size=1)
        if not args.dry_run:
            torch.cuda.set_device(0)
        from megatron_kl.megatron_compat import apply_cpu_shims

        apply_cpu_shims()  # a no-op with CUDA
        parallel_state.initialize_model_parallel(1)
    group = parallel_state.get_tensor_model_parallel_group()
    card = "dry run on the CPU (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name(0)
    for size in args.sizes.split(","):
        tokens, vocab = map(int, size.split("x"))
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            unit = tokens * vocab * torch.finfo(dtype).bits // 8
            floors = {}
            if section == "logits":
                paths = logits_paths(*_gpu_inputs(tokens, vocab, dtype, device=device))
                floors = {name: floor for name, (_, floor) in paths.items()}
                tables = [
                    (
                        f"logits in, {dtype_name}, fwd+bwd, TP=1; ratios vs megatron-core vocab_parallel_cross_entropy",
                        {name: prepare for name, (prepare, _) in paths.items()},
                        "megatron_core_logprobs",
                    )
                ]
            elif section == "truncation":
                tables = []
                for scale in LOGIT_SCALES:
                    logits, reference, targets = _gpu_inputs(tokens, vocab, dtype, scale=scale, device=device)
                    tables.append(
                        (
                            f"logits in (scale {scale} x randn), {dtype_name}, log-prob + entropy + exact KL "
                            "fwd+bwd in place, TP=1; ratios vs the full softmax",
                            _gpu_truncation_paths(logits, reference, targets, group),
                            "full_stats",
                        )
                    )
            else:
                paths = linear_paths(*_gpu_inputs(tokens, vocab, dtype, hidden_size=args.hidden, device=device))
                baseline = "liger_flce_logprobs" if "liger_flce_logprobs" in paths else "unfused_logprobs_entropy"
                tables = [
                    (
                        f"hidden in (H={args.hidden}), {dtype_name}: projection + statistics, grads w.r.t. hidden "
                        f"and weight; ratios vs {baseline}",
                        {name: prepare for name, (prepare, _) in paths.items()},
                        baseline,
                    )
                ]
            for title, prepared, baseline in tables:
                memory = {name: _gpu_memory(prepare) if device == "cuda" else 0 for name, prepare in prepared.items()}
                times = _interleaved(prepared, args.repeats)
                print(
                    f"\n{card}: {title} ({size}, {args.repeats} rounds; peak CUDA memory over the inputs, "
                    f"in units of one {dtype_name} logits tensor)",
                    flush=True,
                )
                bandwidth = 2 * unit / min(times["copy"]) if "copy" in times else None
                print(
                    f"{'impl':>30s} {'min s':>8s} {'median s':>8s} {'min x':>9s} {'median x':>9s} {'peak MiB':>10s} "
                    f"{'x logits':>8s}" + (f" {'% copy bw':>9s}" if bandwidth else "")
                )
                for name, values in times.items():
                    line = _row(name, values, times[baseline], memory[name], unit)
                    if bandwidth and floors.get(name):
                        line += f" {100 * floors[name] / min(values) / bandwidth:9.1f}"
                    print(line, flush=True)
                if bandwidth:
                    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (a device-to-device copy of one logits tensor)")


def _gpu_truncation_paths(logits, reference, targets, group) -> dict:
    """``TRUNCATIONS``, plus top-p 0.9 with the bisection's older lookup (a pass over the rows per step) beside
    the GPU's default (rows sorted once, a binary search per step)."""
    from megatron_kl.vocab_parallel import truncation
    from megatron_kl.vocab_parallel.stats import fused_stats
    from megatron_kl.vocab_parallel.truncation import Truncation

    def prepare(rule, lookup="auto"):
        x = logits.clone().requires_grad_(True)

        def run():
            truncation.BISECTION_LOOKUP = lookup
            try:
                stats = fused_stats(
                    x,
                    group,
                    targets=targets,
                    reference_logits=reference,
                    inplace_backward=True,
                    truncation=None if rule is None else Truncation(*rule),
                )
                (stats.logprobs.float().sum() + stats.entropy.float().sum() + stats.kl.float().sum()).backward()
            finally:
                truncation.BISECTION_LOOKUP = "auto"

        return run

    paths = {name: (lambda rule=rule: prepare(rule)) for name, rule in TRUNCATIONS.items()}
    paths["top_p0.9_bisection_by_passes"] = lambda: prepare((0, 0.9), "pass")
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=("logits", "chunks", "linear", "truncation", "all"), default="all")
    parser.add_argument(
        "--sizes", default=None, help="TOKENSxVOCAB,... (default: 4096x32768 for logits/chunks, 2048x152064 for linear)"
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=896,
        help="hidden size for the linear section (896: Qwen2.5-0.5B, whose vocabulary is 151936 padded to 152064)",
    )
    parser.add_argument("--chunk", type=int, default=0, help="rows per chunk; 0 = automatic")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the logits, truncation and linear sections at TP=1 on one GPU (CUDA-synchronised "
        "times, peak CUDA memory); cpu: every section, TP=1 and TP=2 gloo ranks",
    )
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="--device cuda: the input dtypes, comma-separated (float32, bfloat16, float16)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="--device cuda on the CPU: every GPU path once through Triton's interpreter at the given "
        "(small) sizes, to check the script itself without a GPU (times mean nothing)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:  # the Triton kernels on CPU tensors (read when the kernels are first imported)
        os.environ["TRITON_INTERPRET"] = "1"
    if args.child:
        section, impl = args.child.split(":")
        print(json.dumps(_measure_memory(section, impl, args.sizes, args.hidden, args.chunk or None)))
        return 0
    sections = ("logits", "chunks", "linear", "truncation") if args.section == "all" else (args.section,)
    for section in sections:
        sub = argparse.Namespace(**vars(args))
        if sub.sizes is None:
            sub.sizes = "2048x152064" if section == "linear" else "4096x32768"
        if args.device == "cuda":
            if section != "chunks":  # the chunk rule is tuned for CPU caches
                run_gpu(sub, section)
            continue
        {"logits": run_logits, "chunks": run_chunks, "linear": run_linear, "truncation": run_truncation}[section](sub)
    return 0


if __name__ == "__main__":
    sys.exit(main())
