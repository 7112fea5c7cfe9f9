"""Extension points from outside the package: a rollout engine, a KL estimator, a model family, a task and a reward
function, each a spec in tests/plugins/toy.py that the package never imports, named in the config as
``tests.plugins.toy:NAME`` and run for real RL steps (the ranks import the module when they read the config)."""

import dataclasses

import pytest
import torch

from megatron_kl.config import MODEL_FAMILIES, ConfigError, from_dict
from megatron_kl.kl.config import ESTIMATORS
from megatron_kl.kl.estimators import token_estimate
from megatron_kl.local_ranks import run_ranks
from megatron_kl.models.output_head import unwrap
from megatron_kl.rollout.registry import ENGINES
from megatron_kl.tasks.base import TASKS
from megatron_kl.train.checks import validate_train_config
from megatron_kl.train.config import TrainConfig
from tests.e2e.runs import short_config
from tests.e2e.workers import started_trainer

PLUGINS = [
    "rollout.engine=tests.plugins.toy:ENGINE",
    "rollout.options={label: mine}",
    "kl.estimator=tests.plugins.toy:ESTIMATOR",
    "kl.placement=loss",
    "kl.coef=0.1",
    "kl.aggregation=seq_mean_token_sum",
    "algo.minibatches=1",
    "algo.entropy_coef=0.05",
    "model.architecture=tests.plugins.toy:FAMILY",
    "warm_start.enabled=false",
    "task.name=tests.plugins.toy:TASK",
    "task.options={operators: '+'}",
    "reward.functions=[{name: 'tests.plugins.toy:starts_with_answer', kwargs: {bonus: 0.5}}]",
]


def _steps_worker(rank, world, cfg_dict: dict, steps: int):
    from tests.plugins import toy

    with started_trainer(cfg_dict) as (trainer, prepared):
        records = [trainer.step(step).metrics for step in range(steps)]
        engine_class = type(trainer.engine).__name__
        layers = unwrap(trainer.train_state.chunks[0]).decoder.layers
        attention = type(layers[0].self_attention.core_attention).__name__
        q_norm = layers[0].self_attention.q_layernorm is not None
    return {
        "records": records,
        "calls": dict(
            toy.CALLS,
            engine_options=dataclasses.asdict(toy.CALLS["engine_options"]),
            task_options=dataclasses.asdict(toy.CALLS["task_options"]),
        ),
        "engine": engine_class,
        "attention": attention,
        "q_norm": q_norm,
        "problem": prepared.task.problem("train", 0).prompt_text,
    }


def test_an_engine_estimator_family_task_and_reward_from_outside_the_package_run_rl_steps(tmp_path):
    data = short_config(
        tmp_path / "run",
        str(tmp_path / "cache"),
        "train.steps=2",
        "train.prompts_per_step=4",
        "train.group_size=2",
        *PLUGINS,
    )
    cfg = from_dict(TrainConfig, data)
    validate_train_config(cfg, tokenizer_vocab=cfg.model.vocab_size)
    out = run_ranks(_steps_worker, 1, data, 2)[0]
    calls, records = out["calls"], out["records"]
    # the engine: built with its options, every rollout through it
    assert out["engine"] == "CountingEngine" and calls["engine_options"] == {"label": "mine"}
    assert calls["generate"] >= 2 and calls["prompts"] >= 2 * 4 * 2
    # the model family: its defaults resolved (q/k norms), its block seam's attention in every layer, run
    assert out["attention"] == "CountingAttention" and out["q_norm"] and calls["attention"] > 0
    # the task with its options (additions only) and the reward with its kwargs (0.5 for every response, + 1 if right)
    assert calls["task_options"] == {"operators": "+"} and "+" in out["problem"] and "-" not in out["problem"]
    for r in records:
        right = (r["reward/mean"] - 0.5) * 8  # 8 samples a step
        assert right == pytest.approx(round(right), abs=1e-5) and 0 <= round(right) <= 8, r["reward/mean"]
    # the estimator: the KL term in the loss is coef x mean over sequences of sum_t d_t^2, which is 2 x coef x the
    # logged k3 (= d^2 / 2 to third order) once the policy has moved from the reference (step 0: both the same)
    assert records[0]["loss/kl_term"] == pytest.approx(0.0, abs=1e-12)
    moved = records[1]
    assert moved["kl/k3_sequence"] > 1e-8
    assert moved["loss/kl_term"] == pytest.approx(2 * 0.1 * moved["kl/k3_sequence"], rel=1e-2)


def test_module_names_resolve_to_typed_specs_and_a_wrong_one_names_the_field():
    assert "tests.plugins.toy:ENGINE" in ENGINES and "tests.plugins.toy:FAMILY" in MODEL_FAMILIES
    assert "tests.plugins.toy:ESTIMATOR" in ESTIMATORS and "tests.plugins.toy:TASK" in TASKS
    d = torch.tensor([0.5, -2.0, 40.0])
    value = token_estimate("tests.plugins.toy:ESTIMATOR", d, 20.0, torch.ones(3))
    assert torch.equal(value, torch.tensor([0.25, 4.0, 400.0]))  # clamped to 20 before the estimator, as k1-k3
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine='tests.plugins.toy:FAMILY' names a ModelFamily, not an? "
        r"EngineSpec",
    ):
        from_dict(TrainConfig, {"rollout": {"engine": "tests.plugins.toy:FAMILY"}})
    with pytest.raises(
        ConfigError,
        match=r"kl.estimator='tests.plugins.nothing:X' cannot load it: "
        r"ModuleNotFoundError",
    ):
        from_dict(TrainConfig, {"kl": {"estimator": "tests.plugins.nothing:X"}})
    with pytest.raises(ConfigError, match=r"task.name='chess' must be one of \['arithmetic', 'math', 'dataset'"):
        from_dict(TrainConfig, {"task": {"name": "chess"}})
    with pytest.raises(ConfigError, match=r"rollout.options.colour"):
        validate_train_config(
            from_dict(TrainConfig, {"rollout": {"engine": "tests.plugins.toy:ENGINE", "options": {"colour": "red"}}}),
            99,
        )
    with pytest.raises(ConfigError, match=r"rollout.options=.*rollout.engine=local takes its settings"):
        validate_train_config(from_dict(TrainConfig, {"rollout": {"options": {"label": "x"}}}), 99)


def test_a_spec_registered_from_python_is_a_name_like_a_built_in():
    spec = dataclasses.replace(ESTIMATORS.get("k2"), name="half_square")
    ESTIMATORS.register(spec)
    try:
        assert from_dict(TrainConfig, {"kl": {"estimator": "half_square"}}).kl.estimator == "half_square"
        with pytest.raises(ValueError, match="registered already"):
            ESTIMATORS.register(dataclasses.replace(spec))
    finally:
        ESTIMATORS.unregister("half_square")
    with pytest.raises(ConfigError, match="must be one of"):
        from_dict(TrainConfig, {"kl": {"estimator": "half_square"}})
