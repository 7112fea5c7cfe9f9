"""The loss side under context parallelism: every KL configuration the audit knows (estimator x placement x level x
credit x off-policy weighting, the behaviour-weighted ones with each correction), every aggregation and
correction, GSPO, RPG and pi_old from the update, computed on zigzag shards of CP 2 and 4 (and CP 2 x TP 2, the
vocabulary sharded too) over gloo, against the same sequences on one rank: the loss and every metric on each
rank, the clamp counts summed over the CP ranks, and the gradient w.r.t. the logits (each rank back-propagating
``loss * axis.share``) reassembled in sequence order. Float64 to 1e-12, float32 to 2e-5. Sequences of 13 tokens
(padded to a multiple of 2 cp), responses starting mid-chunk, a one-token and an empty response."""

import pytest
import torch

from megatron_kl.algo.losses import RATIO_LEVELS
from megatron_kl.kl.audit.exact import all_configs, behavior_configs
from megatron_kl.kl.corrections import CORRECTIONS
from megatron_kl.kl.objective import AGGREGATIONS
from megatron_kl.kl.rpg import DIVERGENCES, SURROGATES
from megatron_kl.kl.sequence_axis import (
    LOCAL,
    ContextParallelAxis,
    padded_length,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from megatron_kl.testing import distributed
from tests.distributed.cp_workers import cases, cp_worker, relative, single_rank, total_cases

BATCH, LENGTH, SEED = 5, 13, 3


def _compare(reference: list[dict], per_rank: list[dict], cp: int, tp: int, tol: float) -> None:
    assert len(reference) == total_cases()
    by_position = {(r["cp_rank"], r["tp_rank"]): r["results"] for r in per_rank}
    for index, expected in enumerate(reference):
        where = f"case {index} (cp={cp}, tp={tp})"
        for (cp_rank, _tp_rank), results in by_position.items():
            got = results[index]
            assert relative(got["loss"], expected["loss"]) <= tol, (where, cp_rank, got["loss"], expected["loss"])
            assert got["metrics"].keys() == expected["metrics"].keys(), where
            for key, value in expected["metrics"].items():
                assert relative(got["metrics"][key], value) <= tol, (where, key, got["metrics"][key], value)
        for tp_rank in range(tp):
            counts: dict = {}
            for cp_rank in range(cp):
                for key, value in by_position[(cp_rank, tp_rank)][index]["counts"].items():
                    counts[key] = counts.get(key, 0) + value
            assert {k: v for k, v in counts.items() if v} == {k: v for k, v in expected["counts"].items() if v}, where
        shards = [
            torch.cat([by_position[(c, t)][index]["grad"] for t in range(tp)], -1).movedim(1, -1) for c in range(cp)
        ]
        grad = zigzag_unshard(shards, LENGTH).movedim(-1, 1)
        scale = 1.0 + expected["grad"].abs().max().item()
        error = (grad - expected["grad"]).abs().max().item()
        assert error <= tol * scale, (where, error)


@pytest.mark.parametrize(
    "cp,tp,dtype",
    [(2, 1, "float64"), (4, 1, "float64"), (2, 2, "float64"), (2, 1, "float32")],
    ids=["cp2", "cp4", "cp2-tp2", "cp2-float32"],
)
def test_every_configuration_on_zigzag_shards_equals_one_rank(cp, tp, dtype):
    reference = single_rank(SEED, BATCH, LENGTH, dtype)
    assert any(r["loss"] != 0 for r in reference) and any(r["grad"].abs().max() > 0 for r in reference)
    per_rank = distributed.run_ranks(cp_worker, cp * tp, cp, tp, SEED, BATCH, LENGTH, dtype)
    _compare(reference, per_rank, cp, tp, 1e-12 if dtype == "float64" else 2e-5)


def test_the_cases_cover_every_audited_configuration():
    covered = {case["kl"].name for case in cases()}
    audited = {cfg.name for cfg in all_configs(True) + all_configs(False) + behavior_configs()}
    assert audited <= covered, sorted(audited - covered)
    algos = [case["algo"] for case in cases()]
    assert {a.aggregation for a in algos} == set(AGGREGATIONS)
    assert {a.behavior_correction for a in algos} >= set(CORRECTIONS) - {"tis"}
    assert {(a.loss, a.rpg.divergence, a.rpg.surrogate) for a in algos if a.loss == "rpg"} == {
        ("rpg", d, s) for d in DIVERGENCES for s in SURROGATES
    }
    assert {a.ratio_level for a in algos} == set(RATIO_LEVELS) and any(a.old_logprobs == "from_update" for a in algos)


def _axis_worker(rank, world, length):
    """The five reductions of a CP rank on a ramp, with a gradient through prefix and suffix sums."""
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    axis = ContextParallelAxis(dist.group.WORLD)
    x = torch.arange(1.0, 3 * length + 1, dtype=torch.float64).reshape(3, length) ** 1.5
    local = zigzag_shard(x, world, rank).requires_grad_(True)
    valid = zigzag_shard(torch.ones_like(x, dtype=torch.bool), world, rank, pad_value=False)  # padding: False
    padded = torch.nn.functional.pad(x, (0, local.shape[-1] * world - length))
    megatrons = get_batch_on_this_cp_rank({"tokens": padded.clone()}, dist.group.WORLD)["tokens"]
    prefix, suffix = axis.prefix(local), axis.suffix(local)
    weights = zigzag_shard(torch.linspace(-1, 1, 3 * length, dtype=torch.float64).reshape(3, length), world, rank)
    loss = axis.total(weights * prefix * suffix) + axis.seq_sum(local).square().sum()  # the same on every rank
    (grad,) = torch.autograd.grad(loss * axis.share, local)
    return {
        "prefix": prefix.detach(),
        "suffix": suffix.detach(),
        "seq_sum": axis.seq_sum(local).detach(),
        "total": float(axis.total(local)),
        "max": float(axis.maximum(local[valid])),
        "min": float(axis.minimum(local[valid])),
        "grad": grad,
        "megatrons_shard": megatrons,
        "shard": local.detach(),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_prefix_suffix_and_sums_across_shards_equal_the_whole_sequence(world):
    length = 11
    x = (torch.arange(1.0, 3 * length + 1, dtype=torch.float64).reshape(3, length) ** 1.5).requires_grad_(True)
    weights = torch.linspace(-1, 1, 3 * length, dtype=torch.float64).reshape(3, length)
    prefix, suffix = x.cumsum(-1), x.flip(-1).cumsum(-1).flip(-1)
    loss = (weights * prefix * suffix).sum() + x.sum(-1).square().sum()
    (expected_grad,) = torch.autograd.grad(loss, x)
    results = distributed.run_ranks(_axis_worker, world, length)
    for key, expected in (("prefix", prefix), ("suffix", suffix), ("grad", expected_grad)):
        got = zigzag_unshard([r[key] for r in results], length)
        assert torch.allclose(got, expected.detach(), rtol=1e-13, atol=0), key
    for r in results:
        assert torch.equal(r["shard"], r["megatrons_shard"])  # megatron-core's zigzag layout
        assert torch.allclose(r["seq_sum"], x.sum(-1).detach(), rtol=1e-14)
        assert r["total"] == pytest.approx(float(x.sum()), rel=1e-14)
        assert r["max"] == float(x.max()) and r["min"] == float(x.min())


def test_zigzag_shards_cover_the_padded_sequence_once():
    for length, size in ((8, 2), (5, 2), (13, 4), (1, 3)):
        positions = torch.cat([zigzag_positions(length, size, r) for r in range(size)])
        assert sorted(positions.tolist()) == list(range(padded_length(length, size)))
    x = torch.arange(10.0)[None]
    shards = [zigzag_shard(x, 3, r, pad_value=-1.0) for r in range(3)]
    assert all(s.shape[-1] == 4 for s in shards)
    assert torch.equal(zigzag_unshard(shards, 10), x)
    with pytest.raises(ValueError, match="two chunks of equal length"):
        ContextParallelAxis(None, size=2, rank=0).prefix(torch.zeros(1, 3))


class _RecordingAxis(type(LOCAL)):
    """The whole-sequence axis, writing down which cumulative sums a computation asks for."""

    def __init__(self):
        self.used = set()

    def prefix(self, x):
        self.used.add("prefix")
        return super().prefix(x)

    def suffix(self, x):
        self.used.add("suffix")
        return super().suffix(x)


def test_the_audit_tables_cp_column_names_the_cumulative_sums_the_code_takes():
    """``crossing`` (the audit tables' "across CP" column, docs/kl-math.md) names prefix / suffix exactly where the
    KL term's code asks the sequence axis for them, for every audited configuration and behaviour correction."""
    from megatron_kl.kl.corrections import AUDITED
    from megatron_kl.kl.objective import kl_loss, kl_penalty_credit, policy_gradient_surrogate
    from megatron_kl.kl.sequence_axis import crossing

    g = torch.Generator().manual_seed(0)
    lp, ref, mu, full = (torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.3 for _ in range(4))
    mask = torch.ones(3, 6, dtype=torch.bool)
    pairs = [(cfg, None) for cfg in all_configs(True) + all_configs(False)]
    pairs += [(cfg, c) for cfg in behavior_configs() for c in AUDITED]
    for cfg, correction in pairs:
        axis = _RecordingAxis()
        weight = None if correction is None else correction.weights(lp, mu, mask, axis=axis)[0]
        kind = None if correction is None else correction.kind
        axis.used.clear()  # the correction's own sums are in ``crossing`` as "sum", not prefix / suffix
        if cfg.placement == "reward":
            credit = kl_penalty_credit(cfg, lp, ref, mask, mu, full_kl=full.abs(), axis=axis)
            policy_gradient_surrogate(cfg, lp, -cfg.coef * credit, mask, mu, behavior_weight=weight, axis=axis)
        else:
            kl_loss(cfg, lp, ref, mask, mu, full_kl=full.abs(), behavior_weight=weight, axis=axis)
        declared = {need for need in crossing(cfg, kind) if need in ("prefix", "suffix")}
        assert axis.used == declared, (cfg.name, kind, axis.used, declared)
