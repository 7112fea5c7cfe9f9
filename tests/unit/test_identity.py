"""Run identity on resume (run/identity.py): which recorded-vs-current differences refuse a resume."""

from megatron_kl.run.identity import differences, identity_of
from megatron_kl.train.config import TrainConfig, load_train_config, run_key

DEFAULT_CONFIG = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs" / "cpu" / "default.yaml")


def _recorded_by_an_older_version(cfg, *added: str) -> dict:
    """The identity a checkpoint written before the fields ``added`` existed holds."""
    recorded = identity_of(cfg, 1)
    for key in added:
        del recorded[key]
    return recorded


def test_a_field_added_since_the_checkpoint_differs_only_when_set_off_its_default():
    cfg = load_train_config("configs/cpu/default.yaml", [])
    recorded = _recorded_by_an_older_version(cfg, "rollout.partial", "rollout.quantization", "kl.clamp")
    assert differences(recorded, identity_of(cfg, 1), TrainConfig) == []  # at their defaults: the behaviour the run had
    changed = load_train_config("configs/cpu/default.yaml", ["rollout.quantization=fp8", "kl.clamp=10"])
    assert differences(recorded, identity_of(changed, 1), TrainConfig) == [
        "kl.clamp: (absent) -> 10.0",
        "rollout.quantization: (absent) -> 'fp8'",
    ]


def test_removed_and_changed_fields_always_differ():
    cfg = load_train_config("configs/cpu/default.yaml", [])
    recorded = dict(identity_of(cfg, 1), **{"algo.retired_option": True})
    assert differences(recorded, identity_of(cfg, 1), TrainConfig) == ["algo.retired_option: True -> (absent)"]
    other = load_train_config("configs/cpu/default.yaml", ["kl.coef=0.5"])
    assert differences(identity_of(cfg, 1), identity_of(other, 1), TrainConfig) == ["kl.coef: 0.01 -> 0.5"]
    assert differences(identity_of(cfg, 1), identity_of(cfg, 2), TrainConfig) == ["world_size: 1 -> 2"]


def test_what_auto_chose_is_a_declared_resolved_field_outside_the_identity(tmp_path):
    import dataclasses

    import pytest

    from megatron_kl.config import ConfigError, to_dict
    from megatron_kl.kl.config import Verdict

    auto = load_train_config("configs/cpu/default.yaml", ["kl.estimator=auto"])
    (selection,) = [f for f in dataclasses.fields(auto) if f.name == "kl_selection"]
    from megatron_kl.constraints import DERIVED

    assert selection.metadata[DERIVED]  # resolved at load (train/config.resolve), never given
    assert isinstance(auto.kl_selection, Verdict) and auto.kl_selection.unbiased
    assert to_dict(auto)["kl_selection"]["config"]["estimator"] == auto.kl.estimator != "auto"
    assert load_train_config("configs/cpu/default.yaml", []).kl_selection is None
    with pytest.raises(ConfigError, match="unknown config key"):
        load_train_config("configs/cpu/default.yaml", ["kl_selection.target=token_reverse"])
    # the choice is in kl.* already: the same run given the chosen axes has the same identity
    chosen = auto.kl_selection.config
    given = load_train_config(
        "configs/cpu/default.yaml",
        [f"kl.estimator={chosen.estimator}", f"kl.placement={chosen.placement}", f"kl.level={chosen.level}"],
    )
    assert differences(identity_of(auto, 1), identity_of(given, 1), TrainConfig) == []


def test_the_run_key_separates_every_identity_change_and_nothing_else():
    from megatron_kl.train.config import TrainConfig, load_train_config, run_key

    base = load_train_config(DEFAULT_CONFIG)
    name = base.train.output_dir.rsplit("/", 1)[1]
    assert name == base.run_name and len(base.run_name.rsplit("-", 1)[1]) == 6
    assert load_train_config(DEFAULT_CONFIG).train.output_dir == base.train.output_dir  # the same again: resumes
    for change in (
        ["optim.lr=2e-4"],
        ["model.hidden_size=64", "model.ffn_hidden_size=128"],
        ["algo.minibatches=4"],
        ["reward.functions=[{name: exact_match}]"],
        ["rollout.sampling.top_k=5"],
    ):
        other = load_train_config(DEFAULT_CONFIG, change)
        assert other.train.output_dir != base.train.output_dir, change
        assert other.run_name.rsplit("-", 1)[0] == base.run_name.rsplit("-", 1)[0], change  # the axes read the same
    for same in (
        ["eval.k=8"],
        ["logging.tensorboard=false"],
        ["checkpoint.interval=5"],
        ["train.steps=100"],
        ["reward.timeout_s=5"],
    ):
        assert load_train_config(DEFAULT_CONFIG, same).train.output_dir == base.train.output_dir, same
    assert (
        run_key(TrainConfig()) == "" and TrainConfig().run_name == "k1-reward-token-rtg-coef0.001-grpo-ppo-s0-seed1234"
    )
    assert base.run_name.endswith("-e3a8e3")  # stable: the key docs/training.md and the README show


def test_an_edited_reward_file_is_a_changed_run(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def score(sample):\n    return 1.0\n")
    cfg = load_train_config(DEFAULT_CONFIG, [f"reward.functions=[{{name: '{rewards}:score'}}]"])
    recorded = identity_of(cfg, 1)
    rewards.write_text("def score(sample):\n    return 0.5\n")
    changed = differences(recorded, identity_of(cfg, 1), TrainConfig)
    assert len(changed) == 1 and changed[0].startswith(f"file:{rewards}"), changed


def test_loading_resolves_once_and_a_resolved_copy_keeps_its_run_key(tmp_path):
    import dataclasses

    from megatron_kl.train.config import resolve

    cfg = load_train_config("configs/cpu/default.yaml", [f"train.output_dir={tmp_path}", "kl.estimator=auto"])
    assert cfg.kl.estimator != "auto" and cfg.kl_selection is not None and cfg.algo.norm_length is not None
    assert resolve(cfg) == cfg and resolve(cfg).run_name == cfg.run_name  # resolving twice changes nothing
    built = TrainConfig()  # built in Python: nothing resolved until resolve() (loading does it)
    assert built.algo.norm_length is None and resolve(built).algo.norm_length == built.rollout.sampling.max_new_tokens
    # the run's later completion of its sections (the HF model, the stop tokens) keeps the name it was loaded with
    sampling = dataclasses.replace(cfg.rollout.sampling, stop_token_ids=[7])
    copy = cfg.with_sections(rollout=dataclasses.replace(cfg.rollout, sampling=sampling))
    assert copy.run_name == cfg.run_name and run_key(copy) != run_key(cfg)
