"""The study report's stability and kl/biased columns, from hand-made run records."""

from megatron_kl.study.report import _instabilities, _tagged_biased, stability


def test_stability_names_what_went_wrong():
    assert stability(2, 0, 0) == "stable"
    assert stability(1, 1, 0) == "unstable: 1 seed(s) failed"
    assert stability(2, 0, 3) == "unstable: 3 events"
    assert stability(1, 1, 2) == "unstable: 1 seed(s) failed, 2 events"
    assert stability(0, 2, 0) == "no finished seed"


def test_instability_events_and_biased_tag():
    calm = [{"step": i, "kl/exact_token": 0.01, "grad_norm": 1.0, "kl/biased": 0.0} for i in range(10)]
    spiky = [dict(r) for r in calm]
    spiky[4]["grad_norm"] = 50.0  # > 10 x median
    spiky[6]["kl/exact_token"] = float("nan")
    assert _instabilities(calm, 10.0) == 0 and _instabilities(spiky, 10.0) == 2
    assert _tagged_biased([calm, calm]) is False
    tagged = [dict(r, **{"kl/biased": 1.0}) for r in calm]
    assert _tagged_biased([calm, tagged]) is True
    assert _tagged_biased([[{"step": 0, "reward/mean": 1.0}]]) is None  # no KL term: no tag
