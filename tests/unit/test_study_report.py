"""The study report's stability and kl/biased columns, from hand-made run records."""

from megatron_kl.study.report import _instabilities, _tagged_biased, stability


def test_stability_names_what_went_wrong():
    assert stability(2, 0, 0) == "stable"
    assert stability(1, 1, 0) == "unstable: 1 seed(s) failed"
    assert stability(2, 0, 3) == "unstable: 3 events"
    assert stability(1, 1, 2) == "unstable: 1 seed(s) failed, 2 events"
    assert stability(0, 2, 0) == "no finished seed"


def test_instability_events_and_biased_tag():
    calm = [{"step": i, "kl/exact_token": 0.01, "optim/grad_norm": 1.0, "kl/biased": 0.0} for i in range(10)]
    spiky = [dict(r) for r in calm]
    spiky[4]["optim/grad_norm"] = 50.0  # > 10 x median
    spiky[6]["kl/exact_token"] = float("nan")
    assert _instabilities(calm, 10.0) == 0 and _instabilities(spiky, 10.0) == 2
    assert _tagged_biased([calm, calm]) is False
    tagged = [dict(r, **{"kl/biased": 1.0}) for r in calm]
    assert _tagged_biased([calm, tagged]) is True
    assert _tagged_biased([[{"step": 0, "reward/mean": 1.0}]]) is None  # no KL term: no tag


def test_old_run_directories_read_under_current_names(tmp_path):
    """A metrics.jsonl written before the renames (eval/eval/*, grad_norm, kl/clamped_ppo_ratio) reads with the
    current keys, so the report and plots of an old run directory show its numbers."""
    import json

    from megatron_kl.study.report import _instabilities, _series
    from megatron_kl.train.metric_registry import RENAMED, canonical_record, lookup
    from megatron_kl.train.metrics import read_metrics

    old = [
        {
            "step": 0,
            "eval/eval/pass@1": 0.25,
            "eval/eval/mean@4": 0.5,
            "eval/eval:math500/pass@1": 0.125,
            "eval/ood/pass@1": 0.0,
        },
        {
            "step": 0,
            "grad_norm": 1.0,
            "lr": 1e-5,
            "train/skipped_updates": 0.0,
            "kl/clamped_ppo_ratio": 3,
            "kl/clamped_k3": 1,
            "kl/exact_token": 0.01,
        },
        {"step": 1, "grad_norm": 90.0, "kl/exact_token": 0.01},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    records = read_metrics(path)
    assert records[0] == {
        "step": 0,
        "eval/id/pass@1": 0.25,
        "eval/id/mean@4": 0.5,
        "eval/id:math500/pass@1": 0.125,
        "eval/ood/pass@1": 0.0,
    }
    assert records[1] == {
        "step": 0,
        "optim/grad_norm": 1.0,
        "optim/lr": 1e-5,
        "optim/skipped_updates": 0.0,
        "policy/clamped_ratio": 3,
        "kl/clamped_k3": 1,
        "kl/exact_token": 0.01,
    }
    assert _series(records, "eval/id/mean@k") == {0: 0.5}
    assert _instabilities(records[1:2] * 5 + records[2:], 10.0) == 1  # the grad-norm spike are seen under the new name
    for new in RENAMED.values():
        assert lookup(new) is not None, new  # every new name is registered
    # a record written with both spellings keeps the current key's value
    assert canonical_record({"grad_norm": 1.0, "optim/grad_norm": 2.0}) == {"optim/grad_norm": 2.0}
