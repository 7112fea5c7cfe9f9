"""End-to-end training runs on CPU (short forms; the full default run is marked slow)."""

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from megatron_kl.config import from_dict
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.checks import kl_verdict
from megatron_kl.train.config import TrainConfig
from megatron_kl.train.metrics import read_metrics
from tests.e2e.runs import DEFAULT, Run, assert_same_metrics, short_config, stable
from tests.e2e.workers import train_worker

KL_CONFIGS = [
    ["kl.estimator=k1", "kl.placement=reward", "kl.coef=0.05"],
    ["kl.estimator=k3", "kl.placement=reward", "kl.credit=immediate"],
    ["kl.estimator=k1", "kl.placement=reward", "kl.off_policy=per_decision", "kl.truncate=2.0"],
    ["kl.estimator=k3", "kl.placement=loss", "kl.off_policy=token_is", "algo.ppo_epochs=2"],
    ["kl.estimator=k2", "kl.placement=loss", "kl.level=sequence"],
    ["kl.estimator=full", "kl.placement=loss", "kl.level=sequence", "kl.off_policy=per_decision"],
    ["kl.estimator=full", "kl.placement=reward"],
    ["algo.loss=rpg", "kl.coef=0", "algo.rpg.divergence=ufkl"],
]


@pytest.mark.parametrize("overrides", KL_CONFIGS, ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_every_kl_configuration_trains(tmp_path, warm_cache, overrides):
    cfg = short_config(tmp_path, warm_cache, "train.steps=2", *overrides)
    out = run_ranks(train_worker, 1, cfg, timeout_s=300)[0]
    steps = [r for r in out["metrics"] if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:
        for key in (
            "kl/k1_token",
            "kl/k3_token",
            "kl/exact_token",
            "kl/exact_sequence",
            "entropy/mean",
            "optim/grad_norm",
            "loss/total",
            "policy/clip_fraction",
            "mismatch/abs_logprob_mean",
            "time/update",
        ):
            assert record.get(key) is not None, f"{key} missing or not finite in step {record['step']}"
    assert steps[0]["reward/std"] > 0, "precondition: mixed rewards in the first batch"
    from megatron_kl.train.metric_registry import lookup

    unregistered = sorted({k for r in out["metrics"] for k in r if lookup(k) is None})
    assert not unregistered, f"logged but not in megatron_kl/train/metric_registry.py: {unregistered}"
    # training throughput leaves the step's evaluation out (step 0 evaluates before training)
    first = steps[0]
    assert first["time/eval"] > 0 and first["throughput/tokens_per_s"] == pytest.approx(
        first["throughput/response_tokens"] / (first["time/step"] - first["time/eval"])
    )
    assert steps[1]["kl/exact_token"] > 0  # the policy moved away from the reference
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "summary.json").is_file()
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    for item in overrides:
        key, value = item.split("=")
        node = saved
        for part in key.split("."):
            node = node[part]
        assert node == yaml.safe_load(value)


def test_tp2_matches_tp1(tmp_path, warm_cache):
    base = short_config(tmp_path / "tp1", warm_cache, "rollout.sampling.temperature=1.0")
    tp1 = run_ranks(train_worker, 1, base, timeout_s=300)[0]["metrics"]
    tp2_cfg = short_config(tmp_path / "tp2", warm_cache, "parallel.tensor_parallel=2")
    tp2 = run_ranks(train_worker, 2, tp2_cfg, timeout_s=300)[0]["metrics"]
    assert len(tp1) == len(tp2) == 4
    assert_same_metrics(tp1, tp2, "TP2 vs TP1")


def test_fused_logprob_path_matches_unfused(tmp_path, warm_cache):
    """model.logprob_path=fused (no logits; the exact KL from the reference's hidden states and output
    weight) trains like the unfused path."""
    kl = ["kl.estimator=full", "kl.placement=loss", "kl.level=token"]
    unfused = short_config(tmp_path / "unfused", warm_cache, "model.logprob_path=unfused", *kl)
    fused = short_config(tmp_path / "fused", warm_cache, "model.logprob_path=fused", "model.logprob_chunk_rows=7", *kl)
    a_runs = run_ranks(train_worker, 1, unfused, timeout_s=300)[0]["metrics"]
    b_runs = run_ranks(train_worker, 1, fused, timeout_s=300)[0]["metrics"]
    assert len(a_runs) == len(b_runs) == 4
    for a, b in zip(stable(a_runs), stable(b_runs)):
        assert a.keys() == b.keys()
        for key in a:
            if a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), f"step {a['step']} {key}"
    assert [r for r in b_runs if "reward/mean" in r][-1]["kl/exact_token"] > 0


@pytest.mark.parametrize(
    "kl",
    [
        [
            "kl.estimator=k3",
            "kl.placement=loss",
            "kl.off_policy=token_is",
            "algo.behavior_correction=tis",
            "algo.entropy_coef=0.01",
            "algo.ppo_epochs=2",
        ],
        ["kl.estimator=k1", "kl.placement=reward", "kl.coef=0.05", "kl.aggregation=seq_mean_token_sum"],
        ["algo.loss=rpg", "kl.coef=0", "algo.rpg.divergence=ufkl", "algo.rpg.coef=0.1", "algo.ppo_epochs=2"],
        [
            "algo.loss=rpg",
            "kl.coef=0",
            "algo.rpg.divergence=rkl",
            "algo.rpg.surrogate=differentiable",
            "algo.rpg.clip_low=null",
            "algo.rpg.clip_high=null",
            "algo.rpg.dual_clip=null",
            "algo.rpg.coef=0.1",
        ],
    ],
    ids=["k3-loss-tokenis-tis-entropy", "k1-reward", "rpg-ufkl-reinforce", "rpg-rkl-differentiable"],
)
def test_fused_single_pass_trains_like_recompute(tmp_path, warm_cache, kl):
    """model.fused_grad=in_forward (gradients formed in the forward sweep) = recompute, step by step."""
    runs = {}
    for mode in ("recompute", "in_forward"):
        cfg = short_config(
            tmp_path / mode,
            warm_cache,
            "model.logprob_path=fused",
            f"model.fused_grad={mode}",
            "model.logprob_chunk_rows=5",
            *kl,
        )
        runs[mode] = stable(run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"])
    assert len(runs["recompute"]) == len(runs["in_forward"]) == 4
    for a, b in zip(runs["recompute"], runs["in_forward"]):
        for key in a:
            if a[key] is None:
                continue
            # sampler-vs-trainer log-prob mismatches are fp32 rounding (~1e-6) on both paths: they agree to
            # that floor, not relatively
            tolerance = 1e-5 if key.startswith("mismatch/") else 1e-6
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=tolerance), f"step {a['step']} {key}"


def test_async_staleness_one_runs_and_logs_staleness(tmp_path, warm_cache):
    cfg = short_config(
        tmp_path,
        warm_cache,
        "train.staleness=1",
        "train.steps=4",
        "kl.estimator=k3",
        "kl.placement=loss",
        "kl.off_policy=token_is",
        "algo.behavior_correction=tis",
    )
    records = [r for r in run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"] if "reward/mean" in r]
    assert [r["staleness/max"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert records[0]["mismatch/abs_logprob_mean"] < 1e-4  # on-policy warm-up batch: numerical mismatch only
    assert all(r["mismatch/abs_logprob_mean"] > 1e-4 for r in records[1:])  # stale sampler
    assert all(r["is/ratio_mean"] != 1.0 for r in records[1:])


@pytest.mark.parametrize(
    "override, message",
    [
        ("kl.estimator=k4", "kl.estimator='k4' must be one of"),
        ("train.group_size=0", "train.group_size=0 must be >= 1"),
        ("model.vocab_size=8", "model.vocab_size=8 is smaller than the task tokenizer"),
        ("train.stpes=3", "unknown config key(s) ['train.stpes']"),
        ("algo.loss=rpg", "set kl.coef=0"),
        ("rollout.sampling.temperature=-1", "rollout.sampling.temperature=-1"),
        ("parallel.tensor_parallel=3", "tensor_parallel"),
        ("model.fused_grad=in_forward kl.level=sequence", "model.fused_grad=in_forward needs a row-separable loss"),
        ("init.hf_checkpoint=/nonexistent/model", "init.hf_checkpoint='/nonexistent/model' names no directory"),
    ],
)
def test_bad_config_values_fail_with_the_field_named(tmp_path, capsys, override, message):
    """In-process: ``train`` runs the same checks (loop.prepare) before anything starts as ``--check`` does here;
    the CLI's own exit code is the next test's."""
    from megatron_kl.train.cli import run as train_main

    code = train_main(
        str(DEFAULT),
        [f"train.output_dir={tmp_path / 'run'}", "warm_start.enabled=false", *override.split()],
        check_only=True,
    )
    output = capsys.readouterr().err
    assert code == 2, output[-2000:]
    assert message in output, output[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_bad_config_value_exits_2_before_anything_starts(tmp_path):
    code, output = Run(
        tmp_path / "log.txt",
        "--config",
        str(DEFAULT),
        f"train.output_dir={tmp_path / 'run'}",
        "warm_start.enabled=false",
        "parallel.tensor_parallel=3",
    ).wait(300)
    assert code == 2 and "tensor_parallel" in output, output[-2000:]
    assert "host_malloc" not in output and not (tmp_path / "run").exists()  # nothing was set up


def test_default_config_improves_in_domain_accuracy_over_its_warm_start(tmp_path):
    """The README's main job, as written (the shipped warm start, 60 RL steps: ~20 s). RL raises the sampled
    accuracy (mean@4, what the RL objective is the expectation of); greedy pass@1 starts high after the warm start
    (0.953) and must not fall. The OOD split scores above 0 from the start."""
    code, output = Run(
        tmp_path / "log.txt",
        "--config",
        str(DEFAULT),
        f"train.output_dir={tmp_path / 'run'}",
        f"warm_start.cache_dir={tmp_path / 'cache'}",
        "logging.progress=false",
    ).wait(900)
    assert code == 0, output[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    assert after["eval/id/mean@4"] > before["eval/id/mean@4"] + 0.02, (before, after)
    assert after["eval/id/pass@1"] > before["eval/id/pass@1"] - 0.02, (before, after)
    assert before["eval/ood/pass@1"] > 0.02 and "eval/ood/pass@1" in after and Path(summary["plots"]).is_file()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len([r for r in records if "reward/mean" in r]) == 60


def test_train_starts_from_hf_checkpoint_and_exports_hf(tmp_path, warm_cache):
    """init.hf_checkpoint streams an HF Qwen3 model into policy and reference; checkpoint.export_hf writes
    the policy back as HF (lr=0: bit-identical to the source); a model section that does not match
    config.json is an error naming the fields."""
    from safetensors.torch import load_file

    from megatron_kl.testing.distributed import RankFailure
    from tests.distributed.hf_workers import make_hf_model

    source = make_hf_model("qwen3", tmp_path / "qwen3")
    model = [
        "model.architecture=qwen3",
        "model.num_layers=4",
        "model.hidden_size=64",
        "model.ffn_hidden_size=96",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.kv_channels=24",
        "model.vocab_size=61",
        "model.tie_word_embeddings=true",
        "model.rope_theta=1000000.0",
        "model.norm_epsilon=1e-6",
    ]
    cfg = short_config(
        tmp_path / "run",
        warm_cache,
        *model,
        f"init.hf_checkpoint={source}",
        "optim.lr=0.0",
        "train.steps=1",
        "checkpoint.interval=1",
        "checkpoint.export_hf=true",
    )
    out = run_ranks(train_worker, 1, cfg, timeout_s=300)[0]
    step = next(r for r in out["metrics"] if "reward/mean" in r)
    assert step["kl/exact_token"] == pytest.approx(0.0, abs=1e-7)  # policy == reference == the HF model
    exported = tmp_path / "run" / "checkpoints" / "step_000001" / "hf"
    original, back = load_file(str(source / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[k], v) for k, v in original.items())
    assert (exported / "chat_template.jinja").is_file()
    bad = short_config(
        tmp_path / "bad",
        warm_cache,
        *model[:-1],
        "model.norm_epsilon=1e-5",
        f"init.hf_checkpoint={source}",
        "train.steps=1",
    )
    with pytest.raises(RankFailure, match="model.norm_epsilon=1e-05 but .* has 1e-06"):
        run_ranks(train_worker, 1, bad, timeout_s=300)


CORRECTION_CONFIGS = [  # several put the correction's weights on the KL term too (kl.off_policy=behavior)
    ["algo.behavior_correction=token_tis", "kl.off_policy=behavior", "kl.estimator=k3"],
    [
        "algo.behavior_correction=sequence_tis",
        "algo.tis_cap=4.0",
        "kl.off_policy=behavior",
        "kl.estimator=k1",
        "kl.placement=reward",
        "kl.target=sequence_reverse",
    ],
    ["algo.behavior_correction=token_mask", "kl.off_policy=behavior"],
    [
        "algo.behavior_correction=sequence_mask",
        "algo.mask_high=10.0",
        "kl.off_policy=behavior",
        "kl.estimator=k2",
        "kl.level=sequence",
    ],
    ["algo.behavior_correction=geometric_mask"],
    ["algo.behavior_correction=icepop", "algo.mask_high=5.0"],
    [
        "algo.ratio_level=sequence",
        "algo.clip_low=0.003",
        "algo.clip_high=0.004",
        "algo.aggregation=seq_mean_token_mean",
    ],
    [
        "algo.aggregation=seq_mean_token_sum_norm",
        "kl.aggregation=seq_mean_token_sum_norm",
        "kl.estimator=k3",
        "kl.placement=loss",
        "kl.off_policy=token_is",
    ],
    ["kl.estimator=auto", "kl.target=sequence_reverse"],
]


@pytest.mark.parametrize("overrides", CORRECTION_CONFIGS, ids=lambda o: "-".join(x.split("=")[1] for x in o[:2]))
def test_rollout_corrections_train_asynchronously(tmp_path, warm_cache, overrides):
    """Each correction (and GSPO's ratio, Dr. GRPO's aggregation) at staleness 2: finite steps, the
    correction's and the sampler-mismatch metrics logged, and the stale sampler really is corrected for."""
    cfg = short_config(tmp_path, warm_cache, "train.steps=3", "train.staleness=2", *overrides)
    steps = [r for r in run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"] if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert steps[-1]["staleness/max"] == 2.0
    for record in steps:
        for key in (
            "loss/total",
            "optim/grad_norm",
            "mismatch/k1_token",
            "mismatch/k3_token",
            "is/ratio_min",
            "is/ratio_max",
            "is/ratio_mean",
        ):
            assert record.get(key) is not None, (key, record["step"])
    assert steps[-1]["mismatch/k3_token"] > 0  # a stale sampler
    if "correction" in overrides[0]:
        assert all(r.get("correction/weight_mean") is not None for r in steps)
        assert all(r.get("correction/masked_fraction") is not None for r in steps)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["algo"]["norm_length"] == saved["rollout"]["sampling"]["max_new_tokens"]
    # every step carries the audit's verdict for kl.target in the off-policy regime (staleness 2)
    verdict = kl_verdict(from_dict(TrainConfig, copy.deepcopy(cfg)))
    assert {r["kl/biased"] for r in steps} == {0.0 if verdict.unbiased else 1.0}
    if "kl.estimator=auto" in overrides:  # resolved before training, written out as the concrete configuration
        assert verdict.unbiased and saved["kl"]["estimator"] == "full" and saved["kl"]["off_policy"] == "per_decision"


@pytest.mark.parametrize(
    "overrides",
    [
        ["kl.coef=0"],
        [
            "kl.estimator=k3",
            "kl.placement=loss",
            "kl.level=token",
            "kl.coef=0.05",
            "algo.minibatches=1",
            "algo.old_logprobs=from_update",
        ],
        ["kl.estimator=k1", "kl.placement=reward", "kl.coef=0.05"],
    ],
    ids=["no-kl-term", "k3-loss-from_update", "k1-reward"],
)
def test_metric_only_reference_work_runs_every_interval(tmp_path, warm_cache, overrides):
    """train.reference_metrics_interval=2: without a KL term (kl.coef=0, PPO) the reference forward runs on even
    steps only (kl/* logged there); with a sampled KL estimator the exact full-vocabulary KL is computed on even
    steps only (kl/exact_* there; kl/k1, kl/k3 every step). Every other metric is identical to the every-step
    run, step by step."""
    runs = {}
    for interval in (1, 2):
        cfg = short_config(
            tmp_path / str(interval),
            warm_cache,
            "train.steps=4",
            *overrides,
            f"train.reference_metrics_interval={interval}",
        )
        runs[interval] = [r for r in run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"] if "loss/total" in r]
    every, sparse = runs[1], runs[2]
    no_term = overrides == ["kl.coef=0"]
    sparse_prefix = "kl/" if no_term else "kl/exact_"
    assert [r["step"] for r in every] == [r["step"] for r in sparse] == [0, 1, 2, 3]
    for a, b in zip(every, sparse):
        assert "kl/exact_token" in a and ("kl/exact_token" in b) == (b["step"] % 2 == 0)
        assert ("kl/k3_token" in b) == (b["step"] % 2 == 0 or not no_term)
        same = {k: v for k, v in stable([a])[0].items() if not k.startswith(sparse_prefix) and k != "kl/biased"}
        assert {k: b.get(k) for k in same} == same, b["step"]
    assert every[1]["kl/exact_token"] > 0  # the KL to the reference is measured, not assumed
    if no_term:
        assert sparse[1]["time/reference"] < 0.2 * sparse[0]["time/reference"] + 1e-3


@pytest.mark.parametrize(
    "overrides",
    [
        ["kl.estimator=k1", "kl.placement=reward", "kl.coef=0.05", "algo.behavior_correction=sequence_tis"],
        [
            "kl.estimator=full",
            "kl.placement=loss",
            "train.staleness=1",
            "algo.behavior_correction=token_tis",
            "model.logprob_path=fused",
        ],  # row-separable: the fused single pass, its probe on partial stats
        ["kl.estimator=full", "kl.placement=reward", "kl.off_policy=per_decision", "model.logprob_path=fused"],
    ],
    ids=["k1-reward", "full-loss-async", "full-reward-per_decision"],
)
def test_old_logprobs_from_the_update_forward_match_their_own_pass(tmp_path, warm_cache, overrides):
    """One epoch over one minibatch: algo.old_logprobs=from_update takes pi_old from the update's forward and
    skips the separate pass; every metric (loss, KL credit, corrections, kl/*, entropy, mismatch, grad norm)
    matches the run with the pass of its own, step by step, to fp32 rounding (the two forwards batch rows
    differently)."""
    runs = {}
    for mode in ("recompute", "from_update"):
        cfg = short_config(
            tmp_path / mode, warm_cache, "train.steps=3", "algo.minibatches=1", f"algo.old_logprobs={mode}", *overrides
        )
        runs[mode] = [r for r in run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"] if "loss/total" in r]
    recompute, from_update = runs["recompute"], runs["from_update"]
    assert [r["step"] for r in from_update] == [0, 1, 2]
    for a, b in zip(stable(recompute), stable(from_update)):
        assert set(a) == set(b)
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (key, a["step"])  # fp32 rounding
    assert all(r["time/old_logprobs"] < 1e-3 for r in from_update)
    assert recompute[-1]["kl/exact_token"] > 0 and recompute[-1]["optim/grad_norm"] > 0


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # the CPU default: exact KL in the loss (reference hidden states cut with each microbatch), 2 minibatches
        ["algo.minibatches=1", "algo.old_logprobs=from_update", "model.logprob_path=fused"],
    ],
    ids=["default", "from_update-fused"],
)
def test_token_budget_microbatches_train_identically(tmp_path, warm_cache, overrides):
    """train.micro_batch_tokens: microbatches packed by a token budget, each padded to its own longest row,
    give every metric of the one-microbatch run step by step (fp32 rounding), with fewer padded tokens."""
    runs = {}
    for name, budget in (("whole", []), ("budget", ["train.micro_batch_tokens=40"])):
        cfg = short_config(tmp_path / name, warm_cache, *overrides, *budget)
        runs[name] = [r for r in run_ranks(train_worker, 1, cfg, timeout_s=300)[0]["metrics"] if "loss/total" in r]
    whole, budget = runs["whole"], runs["budget"]
    assert [r["step"] for r in budget] == [0, 1, 2]
    for a, b in zip(stable(whole), stable(budget)):
        assert b["batch/microbatches"] >= 8 and b["batch/padded_tokens"] < a["batch/padded_tokens"]
        assert b["batch/padded_tokens"] >= b["batch/tokens"] == a["batch/tokens"]
        for key, value in a.items():
            if key != "batch/padded_tokens":
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (key, a["step"])
    assert whole[-1]["optim/grad_norm"] > 0 and whole[-1]["kl/exact_token"] > 0


def test_profiled_step_writes_its_trace_and_phase_summary(tmp_path, warm_cache):
    """logging.profile_steps=[1]: step 1 (only) runs under torch.profiler; its Chrome trace holds the phase
    ranges, and the summary puts the update's and the rollout's matrix products in their phases."""
    cfg = short_config(tmp_path, warm_cache, "train.steps=2", "logging.profile_steps=[1]")
    out = run_ranks(train_worker, 1, cfg, timeout_s=300)[0]
    assert [r["step"] for r in out["metrics"] if "loss/total" in r] == [0, 1]
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["step_1.rank0.json", "step_1.rank0.summary.json", "step_1.rank0.txt"]
    trace = json.loads((tmp_path / "profile" / "step_1.rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"megatron_kl/rollout_wait", "megatron_kl/reference", "megatron_kl/update"} <= names
    summary = json.loads((tmp_path / "profile" / "step_1.rank0.summary.json").read_text())
    phases = summary["phases"]
    for name in ("rollout_wait", "reference", "update"):
        assert 0 < phases[name]["gemm_s"] < phases[name]["ops_s"] <= phases[name]["wall_s"], name
    assert sum(p["wall_s"] for p in phases.values()) == pytest.approx(summary["step_s"], rel=1e-6)
    step_1 = next(r for r in out["metrics"] if r.get("step") == 1 and "time/step" in r)
    # the profiled block is the step without its evaluation (none at step 1), without the profiler's own start
    # (inside time/step: tens of ms, as much as a third of this 0.2 s step) and with the logging of its line
    assert summary["step_s"] == pytest.approx(step_1["time/step"], rel=0.5)
    assert "aten::mm" in (tmp_path / "profile" / "step_1.rank0.txt").read_text()
