"""The ``distill:`` section: what it refuses (naming the field and the fix), what it resolves, and what a run with it
is called and logs."""

import json

import pytest

from megatron_kl.config import ConfigError, ModelConfig
from megatron_kl.distill.teacher import check_vocabulary
from megatron_kl.train.checks import distill_verdict
from megatron_kl.train.config import load_train_config
from megatron_kl.train.loop import prepare

BASE = "configs/cpu/default.yaml"
ON = [
    "distill.enabled=true",
    "kl.estimator=k3",
    "distill.teacher.model.vocab_size=32",
    "distill.teacher.model.max_position_embeddings=32",
    "distill.teacher.model.hidden_size=192",
]


def _load(tmp_path, *overrides):
    return load_train_config(BASE, [f"train.output_dir={tmp_path}/run", *ON, *overrides])


def test_off_by_default_and_the_run_keys_stay(tmp_path):
    plain = load_train_config(BASE, [f"train.output_dir={tmp_path}/run"])
    assert not plain.distill.enabled and plain.distill.objective() is None and distill_verdict(plain) is None
    assert "distill" not in plain.run_name
    on = _load(tmp_path)
    assert on.run_name.startswith("distill-full-loss-sequence-coef1-k3-"), on.run_name
    assert on.distill.kl.norm_length == on.rollout.sampling.max_new_tokens  # the Dr. GRPO length resolved for it


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["distill.teacher.source=hf"], "distill.teacher.hf_checkpoint"),
        (["distill.teacher.source=checkpoint"], "distill.teacher.checkpoint"),
        (["distill.kl.coef=0", "distill.task_reward=none"], "distill.kl.coef=0"),
        (["distill.kl.estimator=k9"], "distill.kl.estimator"),
        (["distill.task_reward=maybe"], "distill.task_reward"),
        (["distill.kl.off_policy=behavior"], "distill.kl.off_policy=behavior"),
        (["distill.teacher.warm_start_steps=0"], "distill.teacher.warm_start_steps"),
        (["distill.kl.placement=reward", "distill.kl.credit=immediate"], "distill.kl.credit does not apply"),
        (["distill.kl.estimator=topk", "distill.kl.top_k=32"], "distill.kl.top_k=32 covers the whole vocabulary"),
        (["distill.kl.estimator=topk", "distill.kl.top_k=0"], "distill.kl.top_k"),
        (["distill.kl.estimator=topk", "distill.kl.top_k_tail=drop"], "distill.kl.top_k_tail"),
        (
            ["distill.kl.estimator=topk", "rollout.sampling.top_k=5", "rollout.sampling.distribution=truncated"],
            "distill.kl.estimator=topk with a truncated sampling distribution",
        ),
        (["distill.kl.estimator=topk", "parallel.context_parallel=2"], "parallel.context_parallel=2"),
        (
            ["distill.kl.estimator=topk", "distill.kl.level=token", "distill.kl.off_policy=token_is"],
            "distill.kl.off_policy",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_field(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        _load(tmp_path, *overrides)


def test_auto_resolves_to_an_unbiased_configuration_for_the_declared_target(tmp_path):
    cfg = _load(tmp_path, "distill.kl.estimator=auto", "distill.kl.target=sequence_reverse")
    assert cfg.distill_selection is not None and cfg.distill_selection.unbiased
    assert cfg.distill.kl.estimator != "auto"
    verdict = distill_verdict(cfg)
    assert verdict.unbiased and verdict.config == cfg.distill.kl


def test_the_common_recipe_is_judged_biased_for_the_sequence_kl(tmp_path):
    """Sampled k1 with immediate credit (each token's own log-ratio as its reward): unbiased for no sequence-level
    target; the verdict says so and the run is tagged."""
    cfg = _load(
        tmp_path,
        "distill.kl.estimator=k1",
        "distill.kl.placement=reward",
        "distill.kl.level=token",
        "distill.kl.credit=immediate",
    )
    assert not distill_verdict(cfg).unbiased
    rtg = _load(
        tmp_path,
        "distill.kl.estimator=k1",
        "distill.kl.placement=reward",
        "distill.kl.level=token",
        "distill.kl.credit=reward_to_go",
    )
    assert distill_verdict(rtg).unbiased


def test_vocabulary_and_tokenizer_mismatches_are_refused_naming_both(tmp_path):
    student, teacher = ModelConfig(vocab_size=32), ModelConfig(vocab_size=48)
    with pytest.raises(ConfigError, match="vocabulary size 48.*student.*32"):
        check_vocabulary(student, teacher, None, None)
    mine, theirs = tmp_path / "student", tmp_path / "teacher"
    for directory, vocab in ((mine, {"a": 0}), (theirs, {"b": 0})):
        directory.mkdir()
        (directory / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_vocabulary(student, ModelConfig(vocab_size=32), str(mine), str(theirs))
    (theirs / "tokenizer.json").write_text((mine / "tokenizer.json").read_text())
    check_vocabulary(student, ModelConfig(vocab_size=32), str(mine), str(theirs))


def test_prepare_checks_the_teacher_against_the_student_and_the_task(tmp_path):
    prepare(_load(tmp_path))
    with pytest.raises(ConfigError, match="vocabulary size 40"):
        prepare(_load(tmp_path, "distill.teacher.model.vocab_size=40"))
    with pytest.raises(ConfigError, match="distill.teacher holds 8 positions"):
        prepare(_load(tmp_path, "distill.teacher.model.max_position_embeddings=8"))
    with pytest.raises(ConfigError, match="tensor_parallel x pipeline_parallel = 2 does not divide the 1 ranks"):
        prepare(_load(tmp_path, "distill.teacher.tensor_parallel=2"))
    with pytest.raises(ConfigError, match="tensor_parallel x pipeline_parallel = 2 does not divide the 1 ranks"):
        prepare(_load(tmp_path, "distill.teacher.pipeline_parallel=2"))
    from megatron_kl.distill.teacher import check_teacher

    with pytest.raises(ConfigError, match="do not split over pipeline_parallel=3"):
        check_teacher(_load(tmp_path, "distill.teacher.pipeline_parallel=3"), world_size=3)
    check_teacher(_load(tmp_path, "distill.teacher.pipeline_parallel=2"), world_size=2)  # its own pipeline: accepted
    check_teacher(
        _load(tmp_path, "distill.teacher.tensor_parallel=2", "distill.teacher.model.moe.num_experts=4"), world_size=2
    )  # a mixture-of-experts teacher in its own layout: accepted


def test_the_top_k_approximation_is_named_as_such_and_judged_biased(tmp_path):
    cfg = _load(tmp_path, "distill.kl.estimator=topk", "distill.kl.top_k=8", "distill.kl.top_k_tail=renormalize")
    assert cfg.run_name.startswith("distill-topk8_renormalize-loss-sequence-coef1-"), cfg.run_name
    assert cfg.distill.kl.per_position().estimator == "full" and cfg.distill.kl.per_position().level == "sequence"
    verdict = distill_verdict(cfg)
    assert not verdict.unbiased and verdict.rel_bias > 1e-2
    assert "topk8_renormalize-loss-sequence: BIASED" in verdict.describe()
