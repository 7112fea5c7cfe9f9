"""Reward functions: the built-ins, resolving names (registered, import paths, files), the scorer (weighted sums,
batch calls, concurrency, per-call timeouts) and every failure it guards against under both reward.on_failure
policies, the masked advantages of excluded samples against a float64 reference, and the verifier service client
against the test server's injected faults."""

import math
import random
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_kl.algo.advantages import sequence_advantages
from megatron_kl.config import ConfigError
from megatron_kl.rewards import RewardConfig, RewardFunctionConfig, RewardInput, RewardResult, register, unregister
from megatron_kl.rewards.builtin import boxed_match, exact_match, last_boxed, make_regex_match
from megatron_kl.rewards.config import RewardServiceConfig
from megatron_kl.rewards.scorer import RewardFailed, RewardScorer
from megatron_kl.rollout.engine import EngineBase
from megatron_kl.tasks.arithmetic import ArithmeticTask
from megatron_kl.tasks.base import ArithmeticConfig
from megatron_kl.testing.reward_server import RewardServer


def _sample(response="", answer="", index=0, **fields):
    return RewardInput(
        prompt=f"q{index}",
        response=response,
        answer=answer,
        prompt_ids=(1, 2),
        response_ids=tuple(range(len(response))),
        fields=fields,
        index=index,
        group=index // 2,
    )


def _scorer(functions, task=None, **kwargs):
    cfg = RewardConfig(functions=[RewardFunctionConfig(**f) for f in functions], **kwargs)
    task = task or ArithmeticTask(ArithmeticConfig())
    return RewardScorer.build(cfg, task)


# -- built-ins --
def test_text_builtins():
    assert exact_match(_sample("  42 \n", "42")) == 1.0 and exact_match(_sample("41", "42")) == 0.0
    assert exact_match(_sample("Yes", "yes"), ignore_case=True) == 1.0 and exact_match(_sample("Yes", "yes")) == 0.0
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert boxed_match(_sample("so \\boxed{ 7 }", "7")) == 1.0 and boxed_match(_sample("7", "7")) == 0.0
    grouped = make_regex_match(r"answer: (\S+)")
    assert grouped(_sample("answer: 3 ... answer: 5", "5")) == 1.0 and grouped(_sample("answer: 3", "5")) == 0.0
    assert make_regex_match(r"\d+")(_sample("12 and 13", "13")) == 1.0
    assert grouped(_sample("nothing", "5")) == 0.0


def test_the_arithmetic_builtin_is_the_arithmetic_tasks_score():
    task = ArithmeticTask(ArithmeticConfig(), seed=3)
    scorer = _scorer([{"name": "arithmetic"}], task)
    rng = random.Random(0)
    problems, responses = [], []
    for i in range(200):
        problem = task.problem("train", i)
        target = task.target_ids(problem)
        variants = [
            target,
            target[:-1],
            target + [task.tokenizer.eos_id],
            [task.tokenizer.bos_id] + target,
            [rng.randrange(task.tokenizer.vocab_size) for _ in range(rng.randint(0, 5))],
        ]
        problems.append(problem)
        responses.append(rng.choice(variants))
    from megatron_kl.rewards.scorer import inputs_for
    from megatron_kl.rollout.engine import Completion

    completions = [Completion(p.prompt_ids, r, [0.0] * len(r), "stop", 0) for p, r in zip(problems, responses)]
    scores = scorer.score(inputs_for(problems, completions, 1, task.tokenizer))
    expected = [task.score(p, r) for p, r in zip(problems, responses)]
    assert scores.rewards.tolist() == expected and 0 < sum(expected) < len(expected)


# -- names --
def test_names_resolve_to_registered_imported_and_file_functions(tmp_path, monkeypatch):
    (tmp_path / "lab_rewards.py").write_text("def score(sample, bonus=0.0):\n    return 0.25 + bonus\n")
    (tmp_path / "by_file.py").write_text("def score(sample):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register("constant_one", lambda sample: 1.0)
    try:
        scorer = _scorer(
            [
                {"name": "constant_one", "weight": 2.0},
                {"name": "lab_rewards:score", "kwargs": {"bonus": 0.25}, "weight": -1.0},
                {"name": f"{tmp_path}/by_file.py:score", "label": "by_file"},
            ]
        )
        scores = scorer.score([_sample("x", "y", i) for i in range(4)])
        assert scores.rewards.tolist() == [2.0 - 0.5 + 0.5] * 4
        assert scores.metrics["reward/fn/constant_one"] == 1.0 and scores.metrics["reward/fn/score"] == 0.5
        assert scores.metrics["reward/fn/by_file"] == 0.5
    finally:
        unregister("constant_one")
        sys.modules.pop("lab_rewards", None)


@pytest.mark.parametrize(
    "entry, says",
    [
        ({"name": "no_such_reward"}, r"reward.functions\[0\] \(no_such_reward\): not a built-in"),
        ({"name": "no_such_module_xyz:fn"}, r"cannot import no_such_module_xyz"),
        ({"name": "math:no_such_function"}, r"math has no function 'no_such_function'"),
        ({"name": "/no/such/file.py:fn"}, r"the file .* does not exist"),
        ({"name": "regex_match"}, r"regex_match needs kwargs.pattern"),
        (
            {"name": "regex_match", "kwargs": {"pattern": "("}},
            r"kwargs.pattern: pattern '\(' is not a regular expression",
        ),
        ({"name": "exact_match", "kwargs": {"nope": 1}}, r"unknown kwargs \['nope'\]"),
        ({"name": "exact_match", "mode": "batch"}, r"is called in mode=sample"),
        ({"name": "math:sqrt", "kwargs": {"bonus": 1}}, r"cannot be called as fn\(sample, bonus=...\)"),
    ],
)
def test_a_name_that_cannot_work_is_refused_at_start_naming_the_entry(entry, says):
    with pytest.raises(ConfigError, match=says):
        _scorer([entry])


def test_a_file_that_fails_to_load_is_named(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"loading .*broken.py failed: RuntimeError: boom"):
        _scorer([{"name": f"{tmp_path}/broken.py:fn"}])


def test_config_rules():
    from megatron_kl.config import from_dict

    with pytest.raises(ConfigError, match=r"reward.functions\[0\].name is empty"):
        from_dict(RewardConfig, {"functions": [{"weight": 1.0}]}, "reward.")
    with pytest.raises(ConfigError, match="label"):
        RewardConfig(functions=[RewardFunctionConfig(name="a:f"), RewardFunctionConfig(name="b:f")])
    with pytest.raises(ConfigError, match="every weight is 0"):
        RewardConfig(functions=[RewardFunctionConfig(name="exact_match", weight=0.0)])
    from megatron_kl.train.config import load_train_config

    with pytest.raises(ConfigError, match="reward.service.urls is empty"):
        load_train_config(
            str(Path(__file__).resolve().parents[2] / "configs/cpu/default.yaml"),
            ["reward.functions=[{name: service}]"],
        )


# -- the scorer --
def test_results_with_extra_values_and_batch_calls():
    register(
        "with_extras",
        lambda s: RewardResult(float(s.response == s.answer), {"length": len(s.response), "odd name!": 1.0}),
    )
    calls = []
    register("batched", lambda samples: calls.append(len(samples)) or [0.5] * len(samples), mode="batch")
    try:
        scorer = _scorer([{"name": "with_extras"}, {"name": "batched", "mode": "batch", "weight": 2.0}])
        scores = scorer.score([_sample("ab", "ab", 0), _sample("abcd", "x", 1)])
        assert scores.rewards.tolist() == [2.0, 1.0] and calls == [2]
        assert scores.metrics["reward/extra/length"] == 3.0 and scores.metrics["reward/extra/odd_name_"] == 1.0
        from megatron_kl.train.metric_registry import lookup

        assert all(lookup(k) is not None for k in scores.metrics), scores.metrics
    finally:
        unregister("with_extras")
        unregister("batched")


def test_sample_calls_run_concurrently():
    barrier = threading.Barrier(4, timeout=10)  # passes only if four calls are in flight at once
    register("together", lambda s: barrier.wait() * 0 + 1.0)
    try:
        scores = _scorer([{"name": "together"}], workers=4).score([_sample(index=i) for i in range(8)])
        assert scores.rewards.tolist() == [1.0] * 8
    finally:
        unregister("together")


FAULTY = {
    "raises": lambda s: 1 / 0 if s.index == 1 else 1.0,
    "nan": lambda s: float("nan") if s.index == 1 else 1.0,
    "inf": lambda s: float("-inf") if s.index == 1 else 1.0,
    "text": lambda s: "1.0" if s.index == 1 else 1.0,
    "none": lambda s: None if s.index == 1 else 1.0,
}
SAYS = {
    "raises": "ZeroDivisionError",
    "nan": "reward nan is not finite",
    "inf": "reward -inf is not finite",
    "text": "reward '1.0' is not a number",
    "none": "reward None is not a number",
}


@pytest.mark.parametrize("kind", sorted(FAULTY))
def test_a_failed_call_stops_the_run_naming_function_row_and_error(kind):
    register(f"faulty_{kind}", FAULTY[kind])
    try:
        with pytest.raises(
            RewardFailed,
            match=rf"reward.functions\[0\] \(faulty_{kind}\) failed on sample 1 "
            rf"\(prompt 0: 'q1', answer 'a'\): .*{SAYS[kind]}",
        ):
            _scorer([{"name": f"faulty_{kind}"}]).score([_sample("r", "a", i) for i in range(4)])
    finally:
        unregister(f"faulty_{kind}")


@pytest.mark.parametrize("kind", sorted(FAULTY))
def test_a_failed_call_excludes_the_sample_and_counts_it(kind):
    register(f"faulty_{kind}", FAULTY[kind])
    try:
        scores = _scorer([{"name": f"faulty_{kind}"}], on_failure="exclude").score([_sample(index=i) for i in range(4)])
        assert scores.valid.tolist() == [True, False, True, True] and scores.rewards.tolist() == [1.0, 0.0, 1.0, 1.0]
        assert scores.metrics["reward/failed"] == 1.0 and scores.metrics["reward/failed_fraction"] == 0.25
        assert SAYS[kind] in scores.failures[0].error
    finally:
        unregister(f"faulty_{kind}")


def test_a_call_past_its_timeout_fails_and_a_stuck_call_starves_no_other():
    release = threading.Event()
    register("stuck_first", lambda s: release.wait(30) and 0.0 if s.index == 0 else 1.0)
    try:
        scorer = _scorer([{"name": "stuck_first"}], on_failure="exclude", timeout_s=0.3, workers=1)
        scores = scorer.score([_sample(index=i) for i in range(3)])  # one worker, held by the stuck call
        assert scores.valid.tolist() == [False, True, True]
        assert "no result within reward.timeout_s=0.3s" in scores.failures[0].error
    finally:
        release.set()
        unregister("stuck_first")


@pytest.mark.parametrize(
    "returned, says",
    [
        (lambda samples: [1.0] * (len(samples) - 1), "returned 3 results for 4 samples"),
        (lambda samples: 1.0, "returned a float for 4 samples"),
        (lambda samples: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_a_batch_call_with_the_wrong_count_or_an_error_fails_every_sample(returned, says):
    register("bad_batch", returned, mode="batch")
    try:
        with pytest.raises(RewardFailed, match=says):
            _scorer([{"name": "bad_batch", "mode": "batch"}]).score([_sample(index=i) for i in range(4)])
        scores = _scorer([{"name": "bad_batch", "mode": "batch"}], on_failure="exclude").score(
            [_sample(index=i) for i in range(4)]
        )
        assert not scores.valid.any() and scores.metrics["reward/failed_fraction"] == 1.0
    finally:
        unregister("bad_batch")


# -- advantages of excluded samples --
def _reference(rewards, valid, group_size, estimator, std_normalize=True, eps=1e-6):
    """The estimator on the valid samples alone, float64, written out per group; 0 for the others."""
    r, v = rewards.double().tolist(), valid.tolist()
    out = [0.0] * len(r)
    kept_all = [r[i] for i in range(len(r)) if v[i]]
    for start in range(0, len(r), group_size):
        idx = [i for i in range(start, start + group_size) if v[i]]
        vals = [r[i] for i in idx]
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((x - mean) ** 2 for x in vals) / len(vals))
        for i in idx:
            if estimator == "grpo":
                out[i] = (r[i] - mean) / (std + eps) if std_normalize else r[i] - mean
            elif estimator == "rloo":
                out[i] = r[i] - (sum(vals) - r[i]) / (len(vals) - 1) if len(vals) > 1 else 0.0
            elif estimator == "none":
                out[i] = r[i]
            elif estimator == "reinforce_pp_baseline":
                out[i] = r[i] - mean
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        base = kept_all if estimator == "reinforce_pp" else [out[i] for i in range(len(r)) if v[i]]
        mean = sum(base) / len(base)
        std = math.sqrt(sum((x - mean) ** 2 for x in base) / len(base))
        source = r if estimator == "reinforce_pp" else out
        out = [(source[i] - mean) / (std + eps) if v[i] else 0.0 for i in range(len(r))]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("estimator", ["grpo", "grpo-dr", "rloo", "none", "reinforce_pp", "reinforce_pp_baseline"])
def test_excluded_samples_leave_the_baseline_and_score_zero(estimator):
    torch.manual_seed(0)
    std = estimator != "grpo-dr"
    name = estimator.removesuffix("-dr")
    rewards = torch.rand(24, dtype=torch.float64)
    valid = torch.rand(24) > 0.3
    valid[:4] = False  # a group with no valid sample
    valid[4:8] = torch.tensor([True, False, False, False])  # one valid sample (RLOO: no baseline)
    got = sequence_advantages(rewards, 4, name, std, valid=valid)
    torch.testing.assert_close(got, _reference(rewards, valid, 4, name, std), rtol=1e-12, atol=1e-12)
    assert (got[~valid] == 0).all()
    everything = torch.ones(24, dtype=torch.bool)
    assert torch.equal(
        sequence_advantages(rewards, 4, name, std, valid=everything), sequence_advantages(rewards, 4, name, std)
    )


def test_a_failed_sample_in_a_rollout_batch_is_masked_out_of_the_loss():
    from megatron_kl.rollout.engine import Completion
    from megatron_kl.train.rollouts import RolloutSource

    task = ArithmeticTask(ArithmeticConfig())

    class Engine(EngineBase):
        def generate(self, prompts, sampling, seed=0, budgets=None):
            return [Completion(p, [5, 6, task.tokenizer.eos_id], [-0.1] * 3, "stop", 0) for p in prompts]

    register("fails_on_odd", lambda s: 1 / 0 if s.index % 2 else 1.0)
    try:
        scorer = _scorer([{"name": "fails_on_odd"}], task, on_failure="exclude")
        batch = RolloutSource(task, Engine(), None, 2, 2, 0, 0, scorer=scorer).get(0)
        assert batch.reward_valid.tolist() == [True, False, True, False]
        assert batch.loss_mask[1].sum() == 0 and batch.loss_mask[0].sum() == 3
        assert batch.reward_metrics["reward/failed"] == 2.0
    finally:
        unregister("fails_on_odd")


# -- the verifier service --
def _service(server, **overrides):
    settings = {
        "urls": [server.url],
        "max_retries": 2,
        "backoff_s": 0.01,
        "timeout_s": 5.0,
        "batch_size": 3,
        "concurrency": 2,
        **overrides,
    }
    cfg = RewardConfig(
        functions=[RewardFunctionConfig(name="service")],
        service=RewardServiceConfig(**settings),
        on_failure=overrides.pop("on_failure", "fail") if "on_failure" in overrides else "fail",
    )
    return RewardScorer.build(cfg, ArithmeticTask(ArithmeticConfig()))


SAMPLES = [_sample("7" if i % 2 else "8", "7", i) for i in range(8)]


def test_the_service_scores_in_batches_with_metrics():
    with RewardServer() as server:
        scores = _service(server).score(SAMPLES)
    assert scores.rewards.tolist() == [float(i % 2) for i in range(8)] and server.requests == 3
    assert scores.metrics["reward/extra/length"] == 1.0


@pytest.mark.parametrize("fault", ["500", "malformed", "count", "drop", "slow"])
def test_the_service_retries_a_transient_fault(fault):
    with RewardServer(faults={fault: 1}, first=1, delay_s=1.5) as server:
        scores = _service(server, timeout_s=0.5).score(SAMPLES)
    assert scores.rewards.tolist() == [float(i % 2) for i in range(8)] and server.requests == 4


@pytest.mark.parametrize("fault", ["500", "malformed", "count", "drop", "slow"])
def test_a_service_that_keeps_failing_fails_the_samples_it_was_sent(fault):
    with RewardServer(faults={fault: 1}, delay_s=1.0) as server:
        with pytest.raises(
            RewardFailed, match=r"reward.functions\[0\] \(service\) failed on sample 0 .*attempts failed"
        ):
            _service(server, timeout_s=0.3, max_retries=1).score(SAMPLES)


def test_a_nan_from_the_service_fails_that_sample_only():
    with RewardServer(faults={"nan": 1}) as server:
        cfg = RewardConfig(
            functions=[RewardFunctionConfig(name="service")],
            on_failure="exclude",
            service=RewardServiceConfig(urls=[server.url], batch_size=4),
        )
        scores = RewardScorer.build(cfg, ArithmeticTask(ArithmeticConfig())).score(SAMPLES)
    assert scores.valid.tolist() == [False, True, True, True, False, True, True, True]
    assert "reward nan is not finite" in scores.failures[0].error and server.requests == 2


def test_the_service_token_comes_from_the_environment_and_is_never_shown(monkeypatch):
    secret = "s3cr3t-token-value"
    with RewardServer(token=secret) as server:
        monkeypatch.setenv("LAB_VERIFIER_TOKEN", secret)
        scores = _service(server, token_env="LAB_VERIFIER_TOKEN").score(SAMPLES[:2])
        assert scores.rewards.tolist() == [0.0, 1.0]
        monkeypatch.setenv("LAB_VERIFIER_TOKEN", "wrong")
        with pytest.raises(RewardFailed) as err:
            _service(server, token_env="LAB_VERIFIER_TOKEN").score(SAMPLES[:2])
        assert "401" in str(err.value) and "reward.service.token_env=LAB_VERIFIER_TOKEN" in str(err.value)
        assert secret not in str(err.value) and "wrong" not in str(err.value)
        monkeypatch.delenv("LAB_VERIFIER_TOKEN")
        with pytest.raises(ConfigError, match="reward.service.token_env=LAB_VERIFIER_TOKEN: that environment variable"):
            _service(server, token_env="LAB_VERIFIER_TOKEN")
    with pytest.raises(ConfigError, match="must start with http"):
        RewardScorer.build(
            RewardConfig(
                functions=[RewardFunctionConfig(name="service")], service=RewardServiceConfig(urls=["verifier:8000"])
            ),
            ArithmeticTask(ArithmeticConfig()),
        )


def test_the_service_waits_for_a_late_start_and_names_one_that_never_comes():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    starter = threading.Timer(1.0, lambda: holder.append(RewardServer(port=port).__enter__()))
    holder: list = []
    starter.start()
    try:
        scores = _service(type("S", (), {"url": f"http://127.0.0.1:{port}"})(), startup_timeout_s=20).score(SAMPLES[:2])
        assert scores.rewards.tolist() == [0.0, 1.0]
    finally:
        starter.join()
        for server in holder:
            server.close()
    with pytest.raises(RewardFailed, match=r"not reachable after reward.service.startup_timeout_s=1s"):
        _service(type("S", (), {"url": f"http://127.0.0.1:{port}"})(), startup_timeout_s=1).score(SAMPLES[:2])


def test_the_python_api_loads_a_config_from_a_file_a_dict_or_the_defaults():
    from megatron_kl import api

    path = Path(__file__).resolve().parents[2] / "configs" / "cpu" / "default.yaml"
    from_file = api.load_config(path, ["kl.coef=0.2", "train.steps=3"])
    assert from_file.kl.coef == 0.2 and from_file.train.steps == 3 and from_file.model.hidden_size == 128
    sections = {"kl": {"coef": 0.2}, "train": {"steps": 3}}
    from_dict = api.load_config(sections, ["reward.functions=[{name: exact_match}]"])
    assert from_dict.kl.coef == 0.2 and from_dict.reward.functions[0].name == "exact_match"
    assert sections == {"kl": {"coef": 0.2}, "train": {"steps": 3}}  # the caller's dict is left as it was
    assert api.load_config().kl.coef == api.TrainConfig().kl.coef
    with pytest.raises(ConfigError, match=r"kl.coef=nan must be a number"):
        api.load_config(sections, ["kl.coef=nan"])


def test_an_async_batch_whose_reward_fails_is_raised_where_its_step_takes_it_and_never_checkpointed():
    from megatron_kl.rollout.engine import Completion
    from megatron_kl.train.rollouts import RolloutSource

    task = ArithmeticTask(ArithmeticConfig())

    broken, go, calls = threading.Event(), threading.Event(), []

    class Engine(EngineBase):
        def generate(self, prompts, sampling, seed=0, budgets=None):
            calls.append(seed)
            if len(calls) > 1:  # the batch for step 1, in the background: held until the reward is broken
                go.wait(30)
            return [Completion(p, [5, task.tokenizer.eos_id], [-0.1] * 2, "stop", 0) for p in prompts]

    register("breaks_later", lambda s: 1 / 0 if broken.is_set() else 1.0)
    try:
        source = RolloutSource(
            task, Engine(), None, 2, 2, staleness=1, seed=0, scorer=_scorer([{"name": "breaks_later"}], task)
        )
        assert source.get(0).rewards.tolist() == [1.0] * 4  # the warm-up batch scores; step 1's starts behind it
        broken.set()
        go.set()
        source.wait()  # a weight sync: step 1's batch fails scoring, and no error is raised here (one rank's)
        assert source.state_dict()["queue"] == {}  # the failed batch is not checkpointed
        with pytest.raises(RewardFailed, match=r"breaks_later\) failed on sample 0 .*ZeroDivisionError"):
            source.get(1)
        source.close()
    finally:
        unregister("breaks_later")
