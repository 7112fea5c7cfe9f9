"""The cost of a checkpoint's manifest: SHA-256 of every file once when it is written and once before it is
loaded (megatron_kl/run/manifest.py). Writes a file of ``--mib`` random MiB, then times
``manifest.sha256_of`` over it (``--repeats``, min and median) and, as the baseline measured in the same
run, a plain read of the same file (the I/O a load does anyway). Prints seconds per GB and the ratio.

    python tools/bench_manifest.py --mib 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from megatron_kl.run.manifest import sha256_of


def _read(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.distcp"
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        gb = args.mib * (1 << 20) / 1e9
        times = {"read": [], "sha256": []}
        for _ in range(args.repeats):  # interleaved, page cache warm for both
            for name, fn in (("read", _read), ("sha256", sha256_of)):
                start = time.perf_counter()
                fn(path)
                times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name:7s} min {min(values) / gb:.3f} s/GB  median {statistics.median(values) / gb:.3f} s/GB")
    print(f"sha256 / read (median): {statistics.median(times['sha256']) / statistics.median(times['read']):.1f}x")


if __name__ == "__main__":
    main()
