"""The warm-start cache (the weights the policy AND the KL reference of every run sharing it start from) carries
the SHA-256 of its bytes, written with it and checked at every load: a damaged or digest-less cache is
recomputed, and the recomputed one equals the original bit for bit (the same recipe on the same machine)."""

from megatron_kl.testing.distributed import run_ranks
from tests.e2e.runs import short_config
from tests.e2e.workers import train_worker


def _cache_files(cache):
    weights = sorted(cache.glob("warmstart-*.pt"))
    assert len(weights) == 1, weights
    return weights[0], weights[0].with_name(weights[0].name + ".sha256")


def test_a_damaged_warm_start_cache_is_recomputed_not_trusted(tmp_path):
    from megatron_kl.run.manifest import sha256_of as file_digest

    cache = tmp_path / "cache"
    overrides = ("warm_start.steps=20", "train.steps=1")
    run_ranks(train_worker, 1, short_config(tmp_path / "a", str(cache), *overrides), timeout_s=600)
    weights, digest = _cache_files(cache)
    original = file_digest(weights)
    assert digest.read_text().split()[0] == original
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    assert file_digest(weights) != original
    first = run_ranks(train_worker, 1, short_config(tmp_path / "b", str(cache), *overrides), timeout_s=600)[0]
    weights, digest = _cache_files(cache)
    assert file_digest(weights) == original and digest.read_text().split()[0] == original
    clean = run_ranks(train_worker, 1, short_config(tmp_path / "c", str(cache), *overrides), timeout_s=600)[0]
    kl = [r["kl/exact_token"] for r in first["metrics"] if "kl/exact_token" in r]
    assert kl == [r["kl/exact_token"] for r in clean["metrics"] if "kl/exact_token" in r] and kl


def test_a_cache_without_its_digest_or_with_another_is_not_loaded(tmp_path, caplog):
    import torch

    from megatron_kl.run.manifest import sha256_of as file_digest
    from megatron_kl.train.warmstart import _load_verified, digest_path

    path = tmp_path / "warmstart-0.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    with caplog.at_level("WARNING"):
        assert _load_verified(path) is None and "has no digest" in caplog.text
        digest_path(path).write_text("0" * 64 + "  warmstart-0.pt\n")
        assert _load_verified(path) is None and "does not match its SHA-256" in caplog.text
    digest_path(path).write_text(f"{file_digest(path)}  warmstart-0.pt\n")
    assert torch.equal(_load_verified(path)["w"], torch.arange(4.0))
