"""Benchmark: vocab-parallel fused log-prob + entropy + exact KL against the naive full-vocabulary path.

Naive (the baseline, measured in the same run): float32 log_softmax of the full policy and reference
logits, gather of the target, exp-weighted sums for entropy and KL, forward and backward.
Ours: megatron_kl.kl.vocab_parallel.fused_stats (one process, tp_group=None), chunked, with and without
the in-place backward.

Each measurement runs in a fresh subprocess (glibc told to serve large blocks by mmap so RSS follows live
memory); peak extra memory = peak RSS (ru_maxrss) minus the RSS after
the inputs were allocated, so the inputs themselves are not counted for either path. Time: median of
--repeats runs, forward + backward.

    python tools/bench_vocab_parallel.py                        # default sizes incl. 2048 x 152064
    python tools/bench_vocab_parallel.py --sizes 512x32000 --chunk 512
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _measure(impl: str, tokens: int, vocab: int, chunk: int, repeats: int, temperature: float) -> dict:
    import torch

    from megatron_kl.kl.vocab_parallel import fused_stats

    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab)
    reference = torch.randn(tokens, vocab)
    targets = torch.randint(0, vocab, (tokens,))

    def naive():
        x = logits.clone().requires_grad_(True) if impl == "naive" else None
        logp = torch.log_softmax(x.float() / temperature, -1)
        logq = torch.log_softmax(reference.float() / temperature, -1)
        p = logp.exp()
        loss = logp.gather(-1, targets[:, None]).sum() - (p * logp).sum() + (p * (logp - logq)).sum()
        loss.backward()
        return x.grad

    def ours(inplace: bool):
        x = logits.clone().requires_grad_(True)
        # in place: the gradient is written over the logits (which are a temporary of the output layer in
        # training); here x.grad ends up sharing x's storage
        stats = fused_stats(x, None, targets=targets, reference_logits=reference, temperature=temperature,
                            chunk_size=chunk or None, inplace_backward=inplace)
        (stats.logprobs.sum() + stats.entropy.sum() + stats.kl.sum()).backward()
        return x.grad

    run = {"naive": naive, "fused": lambda: ours(False), "fused_inplace": lambda: ours(True)}[impl]
    # the clone of the input is part of every path; count it in the baseline
    warm = logits.clone()
    baseline = _rss_bytes()
    del warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        grad = run()
        times.append(time.perf_counter() - start)
        del grad
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"time_s": statistics.median(times), "peak_extra_bytes": max(0, peak - baseline)}


def _child(args) -> dict:
    cmd = [sys.executable, __file__, "--child", args.impl_child, "--sizes", args.size_child,
           "--chunk", str(args.chunk), "--repeats", str(args.repeats)]
    # large blocks straight from mmap, returned on free: RSS then tracks live memory, not malloc's cache
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024x32000,2048x152064", help="TOKENSxVOCAB,...")
    parser.add_argument("--chunk", type=int, default=0, help="rows per chunk; 0 = automatic")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        tokens, vocab = map(int, args.sizes.split("x"))
        print(json.dumps(_measure(args.child, tokens, vocab, args.chunk, args.repeats, 0.8)))
        return 0
    print(f"{'tokens x vocab':>18s} {'impl':>14s} {'time s':>9s} {'peak extra MiB':>15s} "
          f"{'mem ratio naive/x':>18s} {'time ratio x/naive':>19s}")
    for size in args.sizes.split(","):
        results = {}
        for impl in ("naive", "fused", "fused_inplace"):
            args.impl_child, args.size_child = impl, size
            results[impl] = _child(args)
        base = results["naive"]
        for impl, r in results.items():
            mem_ratio = base["peak_extra_bytes"] / max(r["peak_extra_bytes"], 1)
            print(f"{size:>18s} {impl:>14s} {r['time_s']:9.3f} {r['peak_extra_bytes'] / 2**20:15.1f} "
                  f"{mem_ratio:18.1f} {r['time_s'] / base['time_s']:19.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
