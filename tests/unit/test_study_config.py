"""A study YAML goes through the training config's constraint system: types, ranges, finiteness, a non-empty and
duplicate-free seed list; each bad value refused naming the field, the shipped presets all load."""

from pathlib import Path

import pytest
import yaml

from megatron_kl.config import ConfigError
from megatron_kl.constraints import SEED_MAX
from megatron_kl.study.grid import load_study

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, **changes) -> Path:
    data = {
        "name": "s",
        "base": str(ROOT / "configs/cpu/default.yaml"),
        "output_dir": str(tmp_path / "out"),
        "seeds": [1, 2],
        "configurations": [{"name": "one", "overrides": ["kl.estimator=k3"]}],
    }
    data.update(changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"instability_factor": float("nan")}, r"instability_factor=nan must be a number, not NaN"),
        ({"instability_factor": float("inf")}, r"instability_factor=inf must be finite"),
        ({"instability_factor": 1}, r"instability_factor=1(\.0)? must be > 1"),
        ({"instability_factor": True}, r"instability_factor=true must be a number, not true/false"),
        ({"collapse_fraction": 2}, r"collapse_fraction=2(\.0)? must be >= 0 and <= 1"),
        ({"collapse_fraction": -0.1}, r"collapse_fraction=-0.1 must be >= 0 and <= 1"),
        ({"seeds": []}, r"seeds=\[\] must list at least one seed"),
        ({"seeds": None}, r"seeds=\[\] must list at least one seed"),
        ({"seeds": [1, 1]}, r"seeds=\[1, 1\] repeats \[1\]"),
        ({"seeds": [-1]}, r"seeds=\[-1\]: \[-1\] outside 0\.\.4294967295"),
        ({"seeds": [SEED_MAX + 1]}, r"outside 0\.\.4294967295"),
        ({"seeds": [1.5]}, r"seeds\[0\]=1\.5 must be an integer"),
        ({"seeds": "abc"}, r"seeds\[0\]='abc' must be an int"),
        ({"claim3_statistic": "spikes"}, r"claim3_statistic='spikes' must be one of \['unstable', 'collapsed'\]"),
        ({"base": "/nonexistent/base.yaml"}, r"base='/nonexistent/base.yaml' names no file"),
        ({"seed": 3}, r"unknown key\(s\) \['seed'\]"),
        (
            {"configurations": [{"name": "one", "overrides": "x"}], "grid": {"kl.estimator": "k3"}},
            r"grid axis 'kl.estimator' must be a non-empty list",
        ),
    ],
)
def test_a_bad_study_value_is_refused_naming_the_field(tmp_path, changes, message):
    path = _write(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as caught:
        load_study(path)
    assert str(path) in str(caught.value)


def test_the_shipped_presets_load_and_keep_their_values(tmp_path):
    for preset in sorted((ROOT / "configs/study").glob("*.yaml")):
        study = load_study(preset)
        assert study.seeds and len(set(study.seeds)) == len(study.seeds), preset
        assert study.instability_factor > 1 and 0 <= study.collapse_fraction <= 1, preset
    study = load_study(_write(tmp_path, seeds=[SEED_MAX, 0], collapse_fraction=0, caveat="two\n  lines"))
    assert study.seeds == [SEED_MAX, 0] and study.collapse_fraction == 0.0 and study.caveat == "two lines"
