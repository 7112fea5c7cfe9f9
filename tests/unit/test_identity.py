"""Run identity on resume (train/identity.py): which recorded-vs-current differences refuse a resume."""

from megatron_kl.train.config import load_train_config
from megatron_kl.train.identity import differences, identity_of


def _recorded_by_an_older_version(cfg, *added: str) -> dict:
    """The identity a checkpoint written before the fields ``added`` existed holds."""
    recorded = identity_of(cfg, 1)
    for key in added:
        del recorded[key]
    return recorded


def test_a_field_added_since_the_checkpoint_differs_only_when_set_off_its_default():
    cfg = load_train_config("configs/cpu/default.yaml", [])
    recorded = _recorded_by_an_older_version(cfg, "rollout.partial", "rollout.quantization", "kl.clamp")
    assert differences(recorded, identity_of(cfg, 1)) == []  # at their defaults: the behaviour the run had
    changed = load_train_config("configs/cpu/default.yaml", ["rollout.quantization=fp8", "kl.clamp=10"])
    assert differences(recorded, identity_of(changed, 1)) == ["kl.clamp: (absent) -> 10.0",
                                                              "rollout.quantization: (absent) -> 'fp8'"]


def test_removed_and_changed_fields_always_differ():
    cfg = load_train_config("configs/cpu/default.yaml", [])
    recorded = dict(identity_of(cfg, 1), **{"algo.retired_option": True})
    assert differences(recorded, identity_of(cfg, 1)) == ["algo.retired_option: True -> (absent)"]
    other = load_train_config("configs/cpu/default.yaml", ["kl.coef=0.5"])
    assert differences(identity_of(cfg, 1), identity_of(other, 1)) == ["kl.coef: 0.01 -> 0.5"]
    assert differences(identity_of(cfg, 1), identity_of(cfg, 2)) == ["world_size: 1 -> 2"]
