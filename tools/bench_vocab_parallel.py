"""Benchmark: log-prob + entropy + exact KL, forward and backward, naive vs unfused vs fused.

Two sections, each against a baseline measured in the same run:

* ``logits`` (input: the logits): naive float32 log_softmax of the full policy and reference logits vs
  megatron_kl.kl.vocab_parallel.fused_stats, chunked, with and without the in-place backward.
* ``linear`` (input: hidden states + output weights, the projection included): naive (full logits, then
  log_softmax) vs unfused (full logits, then fused_stats with the in-place backward: the best path that
  materialises the logits) vs fused linear (megatron_kl.kl.fused_linear: never more than a chunk of
  logits), with a chunk-size sweep for the fused path, and the fused single pass (model.fused_grad=
  in_forward: gradients formed in the forward sweep, for row-separable losses; no recomputed logits).
  Gradients w.r.t. the hidden states and the weight.

Each measurement runs in a fresh subprocess (glibc told to serve large blocks by mmap so RSS follows live
memory); peak extra memory = peak RSS (ru_maxrss) minus the RSS after the inputs were allocated, so the
inputs are not counted for any path (the weight gradient is). Time: median of --repeats runs after
one warm-up run.

    python tools/bench_vocab_parallel.py                           # both sections, default sizes
    python tools/bench_vocab_parallel.py --section linear --sizes 2048x152064 --hidden 896 --chunks 64,256,1024
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

TEMPERATURE = 0.8


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _logits_paths(tokens: int, vocab: int, chunk: int):
    import torch

    from megatron_kl.kl.vocab_parallel import fused_stats

    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab)
    reference = torch.randn(tokens, vocab)
    targets = torch.randint(0, vocab, (tokens,))

    def naive():
        x = logits.clone().requires_grad_(True)
        logp = torch.log_softmax(x / TEMPERATURE, -1)
        logq = torch.log_softmax(reference / TEMPERATURE, -1)
        p = logp.exp()
        loss = logp.gather(-1, targets[:, None]).sum() - (p * logp).sum() + (p * (logp - logq)).sum()
        loss.backward()
        return x.grad

    def ours(inplace: bool):
        x = logits.clone().requires_grad_(True)
        # in place: the gradient is written over the logits (a temporary of the output layer in training)
        stats = fused_stats(x, None, targets=targets, reference_logits=reference, temperature=TEMPERATURE,
                            chunk_size=chunk or None, inplace_backward=inplace)
        (stats.logprobs.sum() + stats.entropy.sum() + stats.kl.sum()).backward()
        return x.grad

    # the clone of the input is part of every path; count it in the baseline
    return {"naive": naive, "fused": lambda: ours(False), "fused_inplace": lambda: ours(True)}, logits.clone


def _linear_paths(tokens: int, vocab: int, hidden_size: int, chunk: int):
    import torch

    from megatron_kl.kl.fused_linear import fused_linear_stats
    from megatron_kl.kl.vocab_parallel import fused_stats

    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size)
    weight = (torch.randn(vocab, hidden_size) / hidden_size ** 0.5).requires_grad_(True)
    reference_hidden = torch.randn(tokens, hidden_size)
    reference_weight = torch.randn(vocab, hidden_size) / hidden_size ** 0.5
    targets = torch.randint(0, vocab, (tokens,))

    def loss_of(stats):
        return stats.logprobs.sum() + stats.entropy.sum() + stats.kl.sum()

    def naive():
        h = hidden.clone().requires_grad_(True)
        logp = torch.log_softmax(h @ weight.t() / TEMPERATURE, -1)
        with torch.no_grad():
            logq = torch.log_softmax(reference_hidden @ reference_weight.t() / TEMPERATURE, -1)
        p = logp.exp()
        loss = logp.gather(-1, targets[:, None]).sum() - (p * logp).sum() + (p * (logp - logq)).sum()
        grads = torch.autograd.grad(loss, (h, weight))
        return grads

    def unfused():
        h = hidden.clone().requires_grad_(True)
        logits = h @ weight.t()
        with torch.no_grad():
            reference_logits = reference_hidden @ reference_weight.t()
        stats = fused_stats(logits, None, targets=targets, reference_logits=reference_logits,
                            temperature=TEMPERATURE, inplace_backward=True)
        del reference_logits
        return torch.autograd.grad(loss_of(stats), (h, weight))

    def fused():
        h = hidden.clone().requires_grad_(True)
        stats = fused_linear_stats(h, weight, None, targets=targets, reference_hidden=reference_hidden,
                                   reference_weight=reference_weight, temperature=TEMPERATURE,
                                   chunk_size=chunk or None)
        return torch.autograd.grad(loss_of(stats), (h, weight))

    def single_pass():  # model.fused_grad=in_forward: the loss is row-separable, dL/d(stats) = 1 per row
        from megatron_kl.kl.fused_linear import default_chunk_rows, fused_linear_grads

        ones = torch.ones(tokens)
        _, grad_hidden, grad_weight = fused_linear_grads(
            hidden, weight.detach(), reference_hidden, reference_weight, targets, None, TEMPERATURE, None,
            chunk or default_chunk_rows(vocab, single_pass=True),
            lambda out, lo, hi: (ones[lo:hi], ones[lo:hi], ones[lo:hi]))
        return grad_hidden, grad_weight

    return {"naive": naive, "unfused": unfused, "fused_linear": fused, "fused_single_pass": single_pass}, hidden.clone


def _measure(section: str, impl: str, size: str, hidden_size: int, chunk: int, repeats: int) -> dict:
    tokens, vocab = map(int, size.split("x"))
    if section == "logits":
        paths, warm_input = _logits_paths(tokens, vocab, chunk)
    else:
        paths, warm_input = _linear_paths(tokens, vocab, hidden_size, chunk)
    run = paths[impl]
    warm = warm_input()
    baseline = _rss_bytes()
    del warm
    times = []
    run()  # warm-up (allocator, thread pool), not timed; its memory counts in the peak
    for _ in range(repeats):
        start = time.perf_counter()
        grads = run()
        times.append(time.perf_counter() - start)
        del grads
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"time_s": statistics.median(times), "peak_extra_bytes": max(0, peak - baseline)}


def _child(section: str, impl: str, size: str, args, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{section}:{impl}", "--sizes", size, "--hidden", str(args.hidden),
           "--chunk", str(chunk), "--repeats", str(args.repeats)]
    # large blocks straight from mmap, returned on free: RSS then tracks live memory, not malloc's cache
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(title: str, size: str, results: dict, base_name: str) -> None:
    base = results[base_name]
    print(f"\n{title}  ({size})")
    print(f"{'impl':>22s} {'time s':>9s} {'peak extra MiB':>15s} {'mem ratio base/x':>17s} {'time ratio x/base':>18s}")
    for impl, r in results.items():
        mem_ratio = base["peak_extra_bytes"] / max(r["peak_extra_bytes"], 1)
        print(f"{impl:>22s} {r['time_s']:9.3f} {r['peak_extra_bytes'] / 2**20:15.1f} {mem_ratio:17.1f} "
              f"{r['time_s'] / base['time_s']:18.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=("logits", "linear", "both"), default="both")
    parser.add_argument("--sizes", default="1024x32000,2048x152064", help="TOKENSxVOCAB,...")
    parser.add_argument("--hidden", type=int, default=896, help="hidden size for the linear section "
                        "(896: Qwen2.5-0.5B, whose vocabulary is 151936 padded to 152064)")
    parser.add_argument("--chunk", type=int, default=0, help="rows per chunk; 0 = automatic")
    parser.add_argument("--chunks", default="64,256,1024", help="fused linear chunk-size sweep (rows)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        section, impl = args.child.split(":")
        print(json.dumps(_measure(section, impl, args.sizes, args.hidden, args.chunk, args.repeats)))
        return 0
    sections = ("logits", "linear") if args.section == "both" else (args.section,)
    for size in args.sizes.split(","):
        if "logits" in sections:
            results = {impl: _child("logits", impl, size, args, args.chunk)
                       for impl in ("naive", "fused", "fused_inplace")}
            _table("logits in: naive log_softmax vs vocab_parallel.fused_stats", size, results, "naive")
        if "linear" in sections:
            results = {impl: _child("linear", impl, size, args, args.chunk) for impl in ("naive", "unfused")}
            results["fused_linear (auto)"] = _child("linear", "fused_linear", size, args, 0)
            results["fused 1-pass (auto)"] = _child("linear", "fused_single_pass", size, args, 0)
            for chunk in (int(c) for c in args.chunks.split(",") if c):
                results[f"fused_linear c={chunk}"] = _child("linear", "fused_linear", size, args, chunk)
                results[f"fused 1-pass c={chunk}"] = _child("linear", "fused_single_pass", size, args, chunk)
            _table(f"hidden in (H={args.hidden}): projection + stats, grads w.r.t. hidden and weight", size,
                   results, "naive")
            unfused = results["unfused"]
            for name in ("fused_linear (auto)", "fused 1-pass (auto)"):
                fused = results[name]
                print(f"{name} vs unfused: memory {unfused['peak_extra_bytes'] / max(fused['peak_extra_bytes'], 1):.1f}x "
                      f"lower, time ratio {fused['time_s'] / unfused['time_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
