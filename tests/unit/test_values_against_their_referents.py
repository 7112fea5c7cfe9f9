"""Values checked against what they refer to, at ``--check`` (``train.loop.prepare``), before anything starts: stop
token ids against the vocabulary, a stop list that replaces the end-of-sequence id named, the longest prompt plus the
longest response against the model's positions; seeds within the generators' range, timeouts with a floor."""

from pathlib import Path

import pytest

from megatron_kl.config import ConfigError
from megatron_kl.tasks.arithmetic import ArithmeticTask
from megatron_kl.tasks.base import ArithmeticConfig
from megatron_kl.train.config import load_train_config
from megatron_kl.train.loop import prepare

ROOT = Path(__file__).resolve().parents[2]


def _prepare(tmp_path, *overrides):
    return prepare(
        load_train_config(ROOT / "configs/cpu/default.yaml", [f"train.output_dir={tmp_path / 'run'}", *overrides])
    )


@pytest.mark.parametrize("stops", ["[32]", "[999]", "[-1]", "[2, 40]"])
def test_stop_token_ids_outside_the_vocabulary_are_refused(tmp_path, stops):
    with pytest.raises(
        ConfigError,
        match=r"rollout.sampling.stop_token_ids=.* outside the vocabulary \(ids 0..31, "
        r"model.vocab_size=32\)",
    ):
        _prepare(tmp_path, f"rollout.sampling.stop_token_ids={stops}")


def test_a_stop_list_without_the_end_of_sequence_id_says_so_and_one_with_it_does_not(tmp_path):
    eos = ArithmeticTask(ArithmeticConfig()).tokenizer.eos_id
    other = (eos + 1) % 32
    notes = _prepare(tmp_path, f"rollout.sampling.stop_token_ids=[{other}]").notes
    assert len(notes) == 1 and f"replaces the end-of-sequence id(s) [{eos}]" in notes[0], notes
    assert _prepare(tmp_path, f"rollout.sampling.stop_token_ids=[{other}, {eos}]").notes == []
    assert _prepare(tmp_path).notes == []  # the default list is the end-of-sequence id


def test_the_longest_prompt_and_response_must_fit_the_positions(tmp_path):
    task = ArithmeticTask(ArithmeticConfig(), eval_size=64)
    observed = max(len(task.problem(split, i).prompt_ids) for split in ("train", "eval", "ood") for i in range(3000))
    assert observed == task.longest_prompt_tokens()  # the bound is reached, and never exceeded
    fits = 32 - observed
    assert _prepare(tmp_path, f"rollout.sampling.max_new_tokens={fits}").config.rollout.sampling.max_new_tokens == fits
    for name in ("rollout.sampling.max_new_tokens", "eval.max_new_tokens"):
        with pytest.raises(
            ConfigError,
            match=rf"{name}={fits + 1} with the task's longest prompt \({observed} tokens\) "
            rf"needs 33 positions.* lower {name} to at most {fits}",
        ):
            _prepare(tmp_path, f"{name}={fits + 1}")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seed=1.0e+23", r"train.seed=\d+ must be >= 0 and <= 4294967295"),
        ("train.seed=4294967296", r"train.seed=4294967296 must be >= 0 and <= 4294967295"),
        ("warm_start.seed=-1", r"warm_start.seed=-1 must be >= 0"),
        ("parallel.distributed_timeout_s=1e-9", r"parallel.distributed_timeout_s=1e-09 must be >= 10"),
        ("rollout.sglang.request_timeout_s=0.001", r"request_timeout_s=0.001 must be >= 0.1"),
        ("reward.timeout_s=0", r"reward.timeout_s=0(\.0)? must be >= 0.1"),
    ],
)
def test_seeds_and_timeouts_are_bounded(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(ROOT / "configs/cpu/default.yaml", [override])
