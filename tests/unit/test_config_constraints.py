"""Config values are types: every numeric field and every string field of the training config declares what it
may hold beside the field (megatron_kl.constraints), and loading refuses anything else with one line naming the
field - NaN, infinities, true/false for numbers, negatives where the constraint excludes them, values outside an
enum, null for a required field, keys given twice, paths that cannot work - for every field, enumerated here."""

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.constraints import DERIVED, constraint_of
from megatron_kl.train.config import TrainConfig, load_train_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "configs" / "cpu" / "default.yaml")


def _leaves(cls, prefix=""):
    """(path, field, base type) of every leaf field a user can give under ``cls`` (not those resolved at load)."""
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        if not item.init or item.metadata.get(DERIVED):
            continue
        hint = hints[item.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) is typing.Union and args else hint
        if dataclasses.is_dataclass(base):
            yield from _leaves(base, prefix + item.name + ".")
        else:
            yield prefix + item.name, item, base


NUMERIC = [(path, item, base) for path, item, base in _leaves(TrainConfig) if base in (int, float)]
STRINGS = [(path, item) for path, item, base in _leaves(TrainConfig) if base is str]


def _refused(override: str, path: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_train_config(DEFAULT, [override])
    message = str(err.value)
    assert path in message and "\n" not in message, message
    return message


def test_every_numeric_and_string_field_declares_a_constraint():
    assert len(NUMERIC) > 100 and len(STRINGS) > 50
    missing = [path for path, item, _ in NUMERIC if constraint_of(item) is None]
    missing += [path for path, item in STRINGS if constraint_of(item) is None]
    assert not missing, f"fields without a declared constraint (megatron_kl.constraints.checked): {missing}"
    vague = [
        path
        for path, item in STRINGS
        if not (constraint_of(item).choices or constraint_of(item).free or constraint_of(item).path)
    ]
    assert not vague, f"string fields neither an enum, free text nor a path: {vague}"


@pytest.mark.parametrize("path, item, base", NUMERIC, ids=[p for p, _, _ in NUMERIC])
def test_numeric_fields_refuse_nan_inf_bools_and_excluded_negatives(path, item, base):
    for spelling in (".nan", "nan", ".inf", "-.inf", "true", "false"):
        _refused(f"{path}={spelling}", path)
    rule = constraint_of(item)
    negative = -1 if base is int else -0.5
    if rule.violation(negative):  # excluded by the declared constraint: refused at load, naming what is allowed
        message = _refused(f"{path}={negative}", path)
        assert rule.describe().removeprefix("finite, ") in message, message
    else:  # declared to allow it: the constraint itself lets it through
        assert rule.ge is None and rule.gt is None, path


@pytest.mark.parametrize(
    "path, item",
    [(p, i) for p, i in STRINGS if constraint_of(i) and constraint_of(i).choices],
    ids=[p for p, i in STRINGS if constraint_of(i) and constraint_of(i).choices],
)
def test_enum_fields_refuse_a_bogus_value_naming_the_choices(path, item):
    message = _refused(f"{path}=bogus_value", path)
    assert str(list(constraint_of(item).choices)) in message, message


@pytest.mark.parametrize(
    "override, says",
    [
        ("kl.coef=nan", "not NaN"),
        ("rollout.sampling.temperature=nan", "not NaN"),
        ("kl.coef=inf", "finite"),
        ("optim.lr=-1", ">= 0"),
        ("optim.lr=nan", "not NaN"),
        ("optim.lr=inf", "finite"),
        ("optim.adam_beta1=1.5", "< 1"),
        ("optim.adam_eps=0", "> 0"),
        ("optim.lr_decay_style=bogus", "cosine"),
        ("optim.warmup_steps=-3", ">= 0"),
        ("optim.clip_grad=-1", "clipping off"),
        ("warm_start.steps=-1", ">= 0"),
        ("train.steps=true", "true/false"),
        ("train.steps=2.5", "integer"),
        ("train.output_dir=null", "must be set"),
        ("train.output_dir=''", "empty"),
        ("warm_start.cache_dir=/dev/null", "is a file"),
        ("train.output_dir=/dev/null/run", "is a file"),
        ("warm_start.checkpoint=/no/such/warm_start.pt", "names no file"),
        ("init.hf_checkpoint=/no/such/model", "names no directory"),
        ("rollout.sampling.max_new_tokens=32", "max_position_embeddings"),
    ],
)
def test_the_values_that_used_to_pass_are_refused_at_load(override, says):
    message = _refused(override, override.split("=")[0])
    assert says in message, message


@pytest.mark.parametrize(
    "overrides, path",
    [
        (["optim.lr_decay_style=cosine", "optim.decay_steps=5", "optim.warmup_steps=5"], "optim.decay_steps"),
        (["optim.min_lr=1", "optim.lr=0.1"], "optim.min_lr"),
        (["algo.mask_low=2", "algo.mask_high=1"], "algo.mask_low"),
    ],
)
def test_cross_field_rules_are_checked_at_load(overrides, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load_train_config(DEFAULT, overrides)


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("kl:\n  coef: 0.1\n  estimator: k3\n  coef: 0.2\n")
    with pytest.raises(ConfigError, match="'coef' is given twice.*lines 2 and 4"):
        load_train_config(str(path))


def test_the_defaults_and_the_shipped_configs_satisfy_every_constraint():
    load_train_config(DEFAULT)
    for path, item, _ in NUMERIC:
        default = item.default
        if default is not dataclasses.MISSING and default is not None:
            assert constraint_of(item).violation(default) is None, path
            assert not (isinstance(default, float) and math.isnan(default)), path


def test_a_section_built_in_python_is_held_to_the_same_declared_constraints():
    from megatron_kl.algo.config import AlgoConfig
    from megatron_kl.kl.config import KLConfig
    from megatron_kl.rollout.config import SamplingConfig

    with pytest.raises(ConfigError, match=r"KLConfig\.estimator='k5' must be one of \['k1', 'k2', 'k3', 'full'"):
        KLConfig(estimator="k5")
    with pytest.raises(ConfigError, match=r"KLConfig\.coef=-0\.1 must be >= 0"):
        KLConfig(coef=-0.1)
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.top_p=0\.0 must be > 0 and <= 1"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ConfigError, match=r"algo\.ppo_epochs=0 must be >= 1"):
        AlgoConfig(ppo_epochs=0)
    assert KLConfig(estimator="k3", coef=0.5).coef == 0.5


def test_the_resumable_fields_are_the_ones_declared_so_and_leave_the_run_identity():
    from megatron_kl.constraints import RESUMABLE, resumable_paths
    from megatron_kl.run.identity_fields import identity_fields, resumable

    paths = resumable_paths(TrainConfig)
    assert "train.output_dir" in paths and "logging." in paths and "rollout.sglang.urls" in paths
    assert not any(p.startswith(("kl.", "model.", "algo.", "optim.")) for p in paths)
    loop = typing.get_type_hints(TrainConfig)["train"]
    declared = {f"train.{f.name}" for f in dataclasses.fields(loop) if f.metadata.get(RESUMABLE)}
    assert declared == {p for p in paths if p.startswith("train.")}
    fields = identity_fields(dataclasses.asdict(TrainConfig()), paths)
    assert (
        "kl.coef" in fields and "train.output_dir" not in fields and not any(k.startswith("logging.") for k in fields)
    )
    assert resumable("eval.k", paths) and not resumable("evaluation.k", paths) and not resumable("kl.coef", paths)
