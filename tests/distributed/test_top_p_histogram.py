"""The top-p cut from mass histograms (C kernels, CPU float32): thresholds equal to the rule written out in
float64 on the shapes users meet (flat and peaked rows, thousands of exact ties, logits ~1e4, -inf logits, rows
of one value, a cut on a shard boundary; a row whose cut's preceding mass lies within 1e-6 of top_p may fall
either way), over 1, 2 and 4 ranks, with the default narrowing, with a cap of 3
copied logits (every row narrows level after level) and with no levels (every row falls back to the bisection);
without a compiler the torch path gives the same supports and says why once."""

import logging

import pytest
import torch

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.testing.worlds import worlds
from tests.distributed.test_truncation import direct_support
from tests.distributed.truncation_workers import histogram_cut_worker, histogram_rows


def _no_compiler() -> bool:
    from megatron_kl.vocab_parallel import native

    return native._compiler() is None


needs_compiler = pytest.mark.skipif(_no_compiler(), reason="no C compiler (cc or $CC): the kernels cannot be built")

CASES = [
    ("flat", 1, 0.9, 1.0),
    ("flat", 2, 0.5, 0.7),
    ("peaked", 3, 0.9, 1.0),
    ("peaked", 4, 0.999, 1.3),
    ("ties", 5, 0.6, 1.0),
    ("large", 6, 0.9, 0.8),
    ("masked", 7, 0.95, 1.0),
    ("shard_boundary", 8, 0.999, 1.0),
]


ROUNDING = 1e-6  # float32 masses: a cut whose preceding mass is this close to top_p may fall either way


def _near_tie(row: torch.Tensor, kept: torch.Tensor, top_p: float, tau: float) -> bool:
    """Whether the support ``kept`` of ``row`` is the rule's up to rounding: a threshold set whose last kept
    position's preceding mass is < top_p + ROUNDING and whose first dropped one's is >= top_p - ROUNDING."""
    values, order = row.double().sort(descending=True)
    probs = torch.softmax(values / tau, -1)
    before = probs.cumsum(0) - probs
    size = int(kept.sum())
    if not torch.equal(kept, row >= values[size - 1].float()):
        return False
    return bool(before[size - 1] < top_p + ROUNDING) and (size == len(row) or bool(before[size] >= top_p - ROUNDING))


def _check(thresholds, cases=CASES):
    for (kind, seed, top_p, tau), threshold in zip(cases, thresholds):
        x = histogram_rows(kind, seed)
        want = direct_support(x.double(), 0, top_p, tau)
        got = x >= threshold[:, None]
        differing = (got != want).any(-1).nonzero().squeeze(-1).tolist()
        wrong = [r for r in differing if not _near_tie(x[r], got[r], top_p, tau)]
        assert not wrong, f"{kind} top_p={top_p} tau={tau}: rows {wrong} differ from the rule beyond rounding"
        assert len(differing) <= 1, f"{kind}: {len(differing)} rows on a rounding tie"
        assert bool((want.sum(-1) < x.shape[-1]).any()), f"{kind}: nothing truncated"


@needs_compiler
@pytest.mark.parametrize("world", worlds([1, 2, 4]))
@pytest.mark.parametrize("cap,levels", [(512, 6), (3, 64), (512, 0)], ids=["default", "narrowing", "bisection"])
def test_histogram_cut_equals_the_rule_over_shards(world, cap, levels):
    per_rank = run_ranks(histogram_cut_worker, world, CASES, cap, levels)
    for rank_thresholds in per_rank[1:]:  # the same threshold on every rank
        assert all(torch.equal(a, b) for a, b in zip(rank_thresholds, per_rank[0]))
    _check(per_rank[0])


def test_without_a_compiler_the_torch_path_gives_the_same_supports(monkeypatch, tmp_path, caplog):
    from megatron_kl.vocab_parallel import native, top_p_histogram
    from megatron_kl.vocab_parallel.truncation import Truncation, support_threshold

    x = histogram_rows("flat", 9)
    with_kernels = support_threshold(x, None, Truncation(0, 0.9))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setenv("MEGATRON_KL_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert not top_p_histogram.supported(x)
            without = support_threshold(x, None, Truncation(0, 0.9))
        assert "slower torch path" in caplog.text and "failed" in caplog.text
    finally:
        native.library.cache_clear()
    _check([with_kernels, without], [("flat", 9, 0.9, 1.0)] * 2)
    assert not list(tmp_path.glob("*.so"))


@needs_compiler
def test_the_build_is_cached_per_source_compiler_and_cpu(monkeypatch, tmp_path):
    from megatron_kl.vocab_parallel import native

    monkeypatch.setenv("MEGATRON_KL_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        built = list(tmp_path.glob("top_p_search-*.so"))
        assert len(built) == 1 and not [p for p in tmp_path.iterdir() if p.is_dir()]  # no scratch left
        stamp = built[0].stat().st_mtime_ns
        native.library.cache_clear()
        assert native.library() is not None and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
        monkeypatch.setattr(native, "_cpu_digest", lambda: "another CPU")
        native.library.cache_clear()
        native.library()
        assert len(list(tmp_path.glob("top_p_search-*.so"))) == 2  # another CPU gets its own build
    finally:
        native.library.cache_clear()


def test_a_forked_child_runs_rows_on_threads_of_its_own(monkeypatch):
    """run_rows' thread pool is per process: a child forked after the parent used it (the parent's pool threads
    do not exist there) still runs every row range instead of waiting forever."""
    import os
    import threading
    import time

    from megatron_kl.vocab_parallel import native

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    seen, meeting = [], [threading.Barrier(2)]

    def record(a, b, c, begin, end):  # both ranges at once: the pool holds two threads, both idle afterwards
        meeting[0].wait(timeout=30)
        seen.append((begin, end))

    native.run_rows(record, 10, 0, 0, 0)
    assert sorted(seen) == [(0, 5), (5, 10)]
    pid = os.fork()
    if pid == 0:  # child: the same call, on a pool of its own
        seen.clear()
        meeting[0] = threading.Barrier(2)
        try:
            native.run_rows(record, 10, 0, 0, 0)
        finally:
            os._exit(0 if sorted(seen) == [(0, 5), (5, 10)] else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child never finished its rows (it used the parent's dead pool)")


@needs_compiler
def test_a_compiler_without_march_native_builds_portably(monkeypatch, tmp_path):
    """A compiler that rejects -march=native (a stand-in script here) still gets the kernels built without it."""
    from megatron_kl.vocab_parallel import native

    fussy = tmp_path / "fussy-cc"
    fussy.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -march=native ] && { echo "unknown -march" >&2; exit 1; }; '
        'done\nexec cc "$@"\n'
    )
    fussy.chmod(0o755)
    monkeypatch.setenv("CC", str(fussy))
    monkeypatch.setenv("MEGATRON_KL_CACHE", str(tmp_path / "cache"))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        assert len(list((tmp_path / "cache").glob("top_p_search-*.so"))) == 1
    finally:
        native.library.cache_clear()
