"""The warm-start cache (the weights the policy AND the KL reference of every run sharing it start from) carries
the SHA-256 of its bytes, written with it and checked at every load: a damaged or digest-less cache is
recomputed, and the recomputed one equals the original bit for bit (the same recipe on the same machine)."""

import pytest

from megatron_kl.testing.distributed import run_ranks
from tests.e2e.test_train import short_config
from tests.e2e.workers import train_worker


def _cache_files(cache):
    weights = sorted(cache.glob("warmstart-*.pt"))
    assert len(weights) == 1, weights
    return weights[0], weights[0].with_name(weights[0].name + ".sha256")


@pytest.mark.parametrize("damage", ["flip", "no_digest"])
def test_a_damaged_warm_start_cache_is_recomputed_not_trusted(tmp_path, damage):
    from megatron_kl.train.warmstart import file_digest

    cache = tmp_path / "cache"
    overrides = ("warm_start.steps=20", "train.steps=1")
    run_ranks(train_worker, 1, short_config(tmp_path / "a", str(cache), *overrides), timeout_s=600)
    weights, digest = _cache_files(cache)
    original = file_digest(weights)
    assert digest.read_text().split()[0] == original
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x10
        weights.write_bytes(bytes(data))
        assert file_digest(weights) != original
    else:
        digest.unlink()
    first = run_ranks(train_worker, 1, short_config(tmp_path / "b", str(cache), *overrides), timeout_s=600)[0]
    weights, digest = _cache_files(cache)
    assert file_digest(weights) == original and digest.read_text().split()[0] == original
    clean = run_ranks(train_worker, 1, short_config(tmp_path / "c", str(cache), *overrides), timeout_s=600)[0]
    kl = [r["kl/exact_token"] for r in first["metrics"] if "kl/exact_token" in r]
    assert kl == [r["kl/exact_token"] for r in clean["metrics"] if "kl/exact_token" in r] and kl
