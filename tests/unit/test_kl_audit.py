"""The exact audit reproduces every row of both tables in docs/kl-math.md, through the public API."""

import pytest
import torch

from megatron_kl.kl import KLConfig
from megatron_kl.kl.audit.exact import TabularProblem, all_configs, audit

ZERO = 1e-9  # exact sums in float64: unbiased means ~1e-15
BIASED = 0.02  # anything biased is off by far more than this on random tables


def _rows(problem, off):
    return {r.name: r for r in audit(problem, off_policy=off, configs=all_configs(off))}


@pytest.fixture(
    scope="module", params=[(3, 3, 0), (3, 3, 1), (2, 4, 2), (4, 2, 3)], ids=lambda p: f"V{p[0]}T{p[1]}s{p[2]}"
)
def tables(request):
    vocab, length, seed = request.param
    problem = TabularProblem.random(vocab, length, seed)
    return _rows(problem, False), _rows(problem, True)


def test_on_policy_table(tables):
    on, _ = tables
    b = {name: row.rel_bias for name, row in on.items()}
    # unbiased for the sequence-level KL gradient
    for name in ("k1-reward-sequence", "k1-reward-token-rtg", "k2-loss-sequence", "full-loss-sequence"):
        assert b[name]["seq"] < ZERO, name
    # Rao-Blackwellised: lowest variance among the unbiased
    rb = on["full-loss-sequence"].variance
    assert rb < on["k1-reward-token-rtg"].variance and rb < on["k2-loss-sequence"].variance
    # k1 in the loss: expectation zero, relative bias exactly 1
    for name in ("k1-loss-token", "k1-loss-sequence"):
        assert abs(b[name]["seq"] - 1.0) < ZERO, name
    # prefix-frozen token-level gradient (missing the future-KL term)
    for name in ("k2-loss-token", "k1-reward-token-imm", "full-loss-token"):
        assert b[name]["token"] < ZERO and b[name]["seq"] > BIASED, name
    # GRPO's default is exactly the token-level FORWARD KL gradient
    assert b["k3-loss-token"]["forward"] < ZERO and b["k3-loss-token"]["seq"] > BIASED
    # biased against every target
    for name in (
        "k3-loss-sequence",
        "k2-reward-token-rtg",
        "k2-reward-token-imm",
        "k2-reward-sequence",
        "k3-reward-token-rtg",
        "k3-reward-token-imm",
        "k3-reward-sequence",
        "full-reward-token-rtg",
    ):
        assert min(b[name].values()) > BIASED, name
        assert on[name].verdict == "biased"
    # exact KL in the reward misses exactly the pathwise term: E[g] = grad seq - grad token
    assert on["full-reward-token-rtg"].verdict == "biased"


def test_full_in_reward_misses_the_pathwise_term():
    problem = TabularProblem.random(3, 3, 5)
    from megatron_kl.kl.audit.exact import _estimator_gradients, exact_targets

    targets = exact_targets(problem, off_policy=False)
    grads, q = _estimator_gradients(problem, KLConfig(estimator="full", placement="reward", coef=0.1), False)
    expectation = (q.view(-1, 1, 1) * grads).sum(0)
    torch.testing.assert_close(expectation, targets["seq"] - targets["token"], rtol=1e-10, atol=1e-12)


def test_off_policy_table(tables):
    _, off = tables
    b = {name: row.rel_bias for name, row in off.items()}
    # token-level target under mu
    for name in ("k1-loss-token-token_is", "k3-loss-token-token_is"):
        assert b[name]["token"] < ZERO, name
    assert min(b["k2-loss-token-token_is"].values()) > BIASED
    # k1 in reward without, or with a PPO-style token ratio: biased for the sequence KL
    assert b["k1-reward-token-rtg"]["seq"] > BIASED
    assert b["k1-reward-token-rtg-token_is"]["seq"] > BIASED
    # per-decision weights: unbiased for the SEQUENCE-level gradient under pi_theta
    assert b["k1-reward-token-rtg-per_decision"]["seq"] < ZERO
    assert b["full-loss-sequence-per_decision"]["seq"] < ZERO


def test_truncation_trades_bias_for_variance():
    problem = TabularProblem.random(3, 3, 0)
    exact = KLConfig(estimator="k1", placement="reward", off_policy="per_decision", coef=0.1)
    capped = KLConfig(estimator="k1", placement="reward", off_policy="per_decision", coef=0.1, truncate=1.0)
    rows = {r.name: r for r in audit(problem, True, [exact, capped])}
    assert rows[exact.name].rel_bias["seq"] < ZERO
    assert rows[capped.name].rel_bias["seq"] > BIASED
    assert rows[capped.name].variance < rows[exact.name].variance


def test_audit_cli_writes_json(tmp_path):
    import json

    from megatron_kl.cli import main

    out = tmp_path / "audit.json"
    assert main(["audit", "--vocab", "2", "--length", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    names = {(r["mode"], r["name"]) for r in rows}
    assert ("on_policy", "k1-reward-token-rtg") in names and ("off_policy", "full-loss-sequence-per_decision") in names
    assert all({"rel_bias", "cosine", "variance", "verdict"} <= set(r) for r in rows)


def test_the_audit_ends_with_a_summary_per_section_and_target():
    from megatron_kl.kl.audit.exact import AuditRow, summarize

    def row(name, seq, token, forward):
        return AuditRow(name, "on_policy", {}, {"seq": seq, "token": token, "forward": forward}, {}, 0.0, "")

    text = summarize(
        [
            (
                "on-policy",
                [row("a", 1e-12, 0.5, float("nan")), row("b", 0.3, 1e-13, float("inf")), row("c", 2.0, 0.1, 0.2)],
            )
        ]
    )
    lines = text.splitlines()
    assert lines[2] == "on-policy, 3 configurations"
    assert lines[3].split() == ["seq", "1", "unbiased", "2", "biased", "worst", "2", "(c)"]
    assert lines[4].split() == ["token", "1", "unbiased", "2", "biased", "worst", "0.5", "(a)"]
    assert lines[5].split() == ["forward", "0", "unbiased", "1", "biased", "worst", "0.2", "(c)", "2", "undefined"]
