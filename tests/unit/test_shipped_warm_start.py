"""The shipped warm start: the default job and every run of the CPU studies start from the committed bytes on
whatever machine runs this, verified by the committed digests; damage and absence are errors, never a silent
retrain."""

import json
import shutil

import pytest
import torch

from megatron_kl.config import ConfigError
from megatron_kl.train import shipped_warmstart, warmstart
from megatron_kl.train.config import load_train_config

DEFAULT = "configs/cpu/default.yaml"


def _committed(key):
    return json.loads((shipped_warmstart.SHIPPED_DIR / shipped_warmstart.MANIFEST).read_text())[key]


def test_the_default_job_starts_from_the_committed_weights_on_this_machine():
    cfg = load_train_config(DEFAULT, [])
    key = warmstart.recipe_key(cfg)
    entry = _committed(key)  # a KeyError here: a keyed field changed; re-make it with tools/ship_warm_start.py
    state = warmstart.warm_start_state(cfg, task=None)  # the trainer's own call (a training path would need a task)
    assert shipped_warmstart.weights_digest(state) == entry["weights_sha256"]
    assert shipped_warmstart.sha256_of(shipped_warmstart.SHIPPED_DIR / entry["file"]) == entry["sha256"]
    assert {t.dtype for t in state.values()} == {torch.float32} and len(state) > 5


@pytest.mark.parametrize("study", ["configs/study/cpu.yaml", "configs/study/cpu-replication.yaml"])
def test_every_run_of_the_cpu_studies_shares_the_default_jobs_shipped_start(study):
    from megatron_kl.study.grid import expand, load_study

    default_key = warmstart.recipe_key(load_train_config(DEFAULT, []))
    spec = load_study(study)
    keys = {warmstart.recipe_key(load_train_config(spec.base, run.overrides)) for run in expand(spec)}
    assert keys == {default_key}


def test_the_distillation_study_starts_student_and_teacher_from_shipped_weights():
    """configs/study/cpu-distill.yaml: every run's student starts from one shipped warm start (400 steps), and its
    teacher is the default job's shipped warm start."""
    from megatron_kl.distill.teacher import _teacher_warm_start_config, teacher_model
    from megatron_kl.study.grid import expand, load_study

    default_key = warmstart.recipe_key(load_train_config(DEFAULT, []))
    spec = load_study("configs/study/cpu-distill.yaml")
    configs = [load_train_config(spec.base, run.overrides) for run in expand(spec)]
    students = {warmstart.recipe_key(cfg) for cfg in configs}
    assert len(students) == 1 and _committed(students.pop())
    teachers = {
        warmstart.recipe_key(_teacher_warm_start_config(cfg, teacher_model(cfg.distill.teacher)))
        for cfg in configs
        if cfg.distill.enabled
    }
    assert teachers == {default_key}


def test_the_seed_enters_the_key_resolved():
    base = load_train_config(DEFAULT, [])
    same = load_train_config(DEFAULT, [f"warm_start.seed={base.train.seed}", "train.seed=7", "optim.lr=1e-3"])
    other = load_train_config(DEFAULT, ["warm_start.seed=7"])
    assert warmstart.recipe_key(same) == warmstart.recipe_key(base) != warmstart.recipe_key(other)


def test_source_train_and_shipped_without_weights(tmp_path):
    assert warmstart.shipped_state(load_train_config(DEFAULT, ["warm_start.source=train"])) is None
    assert warmstart.shipped_state(load_train_config(DEFAULT, ["warm_start.steps=20"])) is None  # auto: train it
    with pytest.raises(ConfigError, match="warm_start.source=shipped.*set warm_start.source=auto"):
        warmstart.shipped_state(load_train_config(DEFAULT, ["warm_start.steps=20", "warm_start.source=shipped"]))


def _copy(tmp_path):
    cfg = load_train_config(DEFAULT, [])
    key = warmstart.recipe_key(cfg)
    directory = tmp_path / "warm_starts"
    shutil.copytree(shipped_warmstart.SHIPPED_DIR, directory)
    return shipped_warmstart.find(key, directory)


def test_a_damaged_or_missing_shipped_file_is_an_error(tmp_path):
    entry = _copy(tmp_path)
    data = bytearray(entry.path.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    entry.path.write_bytes(bytes(data))
    with pytest.raises(shipped_warmstart.ShippedWarmStartError, match="does not match its SHA-256"):
        shipped_warmstart.load(entry)
    entry.path.unlink()
    with pytest.raises(shipped_warmstart.ShippedWarmStartError, match="missing"):
        shipped_warmstart.load(entry)


def test_a_manifest_listing_other_weights_is_an_error(tmp_path):
    entry = _copy(tmp_path)
    manifest = entry.path.parent / shipped_warmstart.MANIFEST
    entries = json.loads(manifest.read_text())
    entries[entry.key]["weights_sha256"] = "0" * 64
    manifest.write_text(json.dumps(entries))
    with pytest.raises(shipped_warmstart.ShippedWarmStartError, match="weights' SHA-256"):
        shipped_warmstart.load(shipped_warmstart.find(entry.key, entry.path.parent))


def test_write_then_load_round_trips_and_the_digest_sees_one_element(tmp_path):
    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(4, dtype=torch.float64)}
    entry = shipped_warmstart.write(state, "k" * 16, "test", tmp_path)
    loaded = shipped_warmstart.load(entry)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    changed = dict(state, **{"a.weight": state["a.weight"].clone()})
    changed["a.weight"][1, 2] = torch.nextafter(changed["a.weight"][1, 2], torch.tensor(1e9))
    assert shipped_warmstart.weights_digest(changed) != shipped_warmstart.weights_digest(state)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda text, key: text[: len(text) // 2], r"manifest .*manifest.json is damaged \(not JSON"),
        (
            lambda text, key: "[1, 2]",
            r"manifest .*manifest.json is damaged: it must map recipe keys to entries, not hold a "
            r"list",
        ),
        (
            lambda text, key: json.dumps({**json.loads(text), key: {"file": "x.safetensors"}}),
            r"the entry of recipe \w+ is damaged \(no text in \['sha256', 'weights_sha256', 'made_with'\]\)",
        ),
        (lambda text, key: json.dumps({**json.loads(text), key: None}), r"the entry of recipe \w+ is damaged"),
    ],
)
def test_a_damaged_manifest_is_named_with_what_is_wrong_and_the_way_out(tmp_path, monkeypatch, damage, message):
    entry = _copy(tmp_path)
    manifest = entry.path.parent / shipped_warmstart.MANIFEST
    manifest.write_text(damage(manifest.read_text(), entry.key))
    monkeypatch.setattr(shipped_warmstart, "SHIPPED_DIR", entry.path.parent)
    cfg = load_train_config(DEFAULT, [])
    with pytest.raises(ConfigError, match=message + ".*reinstall the package, or set warm_start.source=train"):
        warmstart.shipped_entry(cfg)
    assert warmstart.shipped_entry(load_train_config(DEFAULT, ["warm_start.source=train"])) is None  # never read


def test_a_damaged_entry_of_another_recipe_leaves_this_one_alone(tmp_path, monkeypatch):
    entry = _copy(tmp_path)
    manifest = entry.path.parent / shipped_warmstart.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "0" * 16: {"file": 3}}))
    monkeypatch.setattr(shipped_warmstart, "SHIPPED_DIR", entry.path.parent)
    assert warmstart.shipped_entry(load_train_config(DEFAULT, [])) == entry


def test_a_missing_manifest_is_a_stated_fallback_or_an_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(shipped_warmstart, "SHIPPED_DIR", tmp_path / "nothing-here")
    with caplog.at_level("WARNING", logger="megatron_kl.train.warmstart"):
        assert warmstart.shipped_entry(load_train_config(DEFAULT, [])) is None
    assert "shipped warm starts are missing" in caplog.text and "training this recipe's warm start" in caplog.text
    with pytest.raises(ConfigError, match="warm_start.source=shipped: the package's warm-start manifest .* is missing"):
        warmstart.shipped_entry(load_train_config(DEFAULT, ["warm_start.source=shipped"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["warm_start.source=shipped", "warm_start.enabled=false"], "warm_start.enabled=false skips the warm start"),
        (
            ["warm_start.source=shipped", "warm_start.checkpoint=README.md"],
            "warm_start.checkpoint=README.md starts from",
        ),
    ],
)
def test_shipped_with_a_setting_that_skips_it_is_refused(overrides, message):
    with pytest.raises(
        ConfigError, match="warm_start.source=shipped requires the package's warm start, but " + message
    ):
        load_train_config(DEFAULT, overrides)
