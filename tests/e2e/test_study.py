"""`megatron-kl study`: a two-configuration, two-step study (plus one run that fails at runtime) produces
the figures, the report with its sections, and reports the failure instead of dropping it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_kl.config import ConfigError
from megatron_kl.study.grid import expand, load_study

ROOT = Path(__file__).resolve().parents[2]


def _study(tmp_path, warm_cache, configurations, grid=None) -> Path:
    common = [
        f"warm_start.cache_dir={warm_cache}",
        "train.steps=2",
        "train.prompts_per_step=8",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=0",
        "checkpoint.interval=0",
        "logging.tensorboard=false",
        "kl.target=sequence_reverse",
    ]
    data = {
        "name": "ci",
        "base": str(ROOT / "configs" / "cpu" / "default.yaml"),
        "output_dir": str(tmp_path / "out"),
        "seeds": [1],
        "common": common,
        "configurations": configurations,
    }
    if grid:
        data["grid"] = grid
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_study_runs_reports_and_keeps_failures(tmp_path, warm_cache):
    configurations = [
        {"name": "k3-loss", "overrides": ["kl.estimator=k3", "kl.placement=loss"]},
        {
            "name": "k1-reward",
            "overrides": ["kl.estimator=k1", "kl.placement=reward", "kl.aggregation=seq_mean_token_sum"],
        },
        # valid config, fails at runtime: the math task's data file does not exist
        {
            "name": "broken",
            "overrides": [
                "task.name=math",
                "task.math.train_files=[/nonexistent/train.jsonl]",
                "task.math.tokenizer=/nonexistent",
            ],
        },
    ]
    path = _study(tmp_path, warm_cache, configurations)
    done = subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "study", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stderr[-3000:]  # one run failed
    out = tmp_path / "out"
    report = (out / "report.md").read_text()
    for section in ("## Results", "## Figures", "## Failed runs", "## Raw metrics", "### broken-seed1"):
        assert section in report
    assert (out / "figures" / "curves.png").stat().st_size > 1000
    assert (out / "figures" / "final_pass1.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert results["broken"]["seeds_ok"] == 0 and results["broken"]["failed"] == ["broken-seed1"]
    assert results["k3-loss"]["seeds_ok"] == 1 and results["k3-loss"]["eval/id/pass@1"] is not None
    # k3 in the loss, token level, on-policy: biased for the sequence KL; the run logged the tag
    assert "BIASED" in results["k3-loss"]["audit"] and results["k3-loss"]["kl_biased"] is True
    assert "unbiased for kl.target=sequence_reverse" in results["k1-reward"]["audit"]
    assert results["k1-reward"]["kl_biased"] is False
    assert results["k1-reward"]["stability"] == (
        "stable"
        if results["k1-reward"]["instability_events"] == 0
        else f"unstable: {results['k1-reward']['instability_events']} events"
    )
    assert results["broken"]["stability"] == "no finished seed"
    assert "| stability | kl/biased | audit |" in report
    results_section = report[report.index("## Results") :]
    row = next(line for line in results_section.splitlines() if line.startswith("| broken |"))
    assert "| 0 | 1 |" in row
    status = json.loads((out / "status.json").read_text())
    assert status["broken-seed1"]["state"] == "failed" and status["broken-seed1"]["error_tail"]
    assert (out / "runs" / "k3-loss-seed1" / "metrics.jsonl").is_file()


def test_study_config_errors_name_the_run(tmp_path, warm_cache):
    path = _study(tmp_path, warm_cache, [{"name": "bad", "overrides": ["kl.estimator=k9"]}])
    with pytest.raises(ConfigError, match="study run bad-seed1: .*estimator"):
        expand(load_study(path))
    grid = _study(tmp_path, warm_cache, [], grid={"kl.estimator": ["k1", "k3"], "kl.placement": ["reward", "loss"]})
    names = [r.name for r in expand(load_study(grid))]
    assert names == ["k1-reward-seed1", "k1-loss-seed1", "k3-reward-seed1", "k3-loss-seed1"]


def test_quick_claims_preset_runs_and_its_claims_agree_with_the_runs(tmp_path, warm_cache):
    """configs/study/cpu-quick.yaml end to end: the Claims section comes first, every statistic lies in its
    interval, claim 2's in-domain estimate equals the paired difference recomputed from the runs' own metrics,
    the OOD split scores above 0 at the start, and the per-claim figures are written."""
    from megatron_kl.study.series import final, series
    from megatron_kl.train.metrics import read_metrics

    data = yaml.safe_load((ROOT / "configs" / "study" / "cpu-quick.yaml").read_text())
    data.update(base=str(ROOT / data["base"]), output_dir=str(tmp_path / "out"))
    path = tmp_path / "quick.yaml"
    path.write_text(yaml.safe_dump(data))
    # the preset as committed, shortened (fewer steps and problems) to keep the suite's time: the same machinery.
    # task.eval_size=8 is the other end-to-end tests' size, so the warm start is the one they share (warm_cache)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "study",
            "--config",
            str(path),
            f"warm_start.cache_dir={warm_cache}",
            "train.steps=2",
            "eval.interval=2",
            "task.eval_size=8",
            "train.prompts_per_step=4",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    report = (out / "report.md").read_text()
    assert report.index("## Claims") < report.index("## Results") and "Runtime: " in report
    # the preset says, before its verdicts and when it ends, that its sizes decide nothing
    assert report.index("> **Caveat:** this preset checks that a study runs end to end") < report.index("## Claims")
    assert "caveat: this preset checks that a study runs end to end" in done.stdout
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("claim ")]
    assert len(verdicts) == 3 and all(
        line.rsplit(": ", 1)[1] in ("reproduced", "not reproduced", "inconclusive") for line in verdicts
    ), done.stdout
    outcomes = [line for line in done.stderr.splitlines() if "megatron_kl.study: [" in line and ": ok in " in line]
    assert len(outcomes) == 8 and all("final reward" in line and "ID pass@1" in line for line in outcomes), outcomes
    claims = json.loads((out / "claims.json").read_text())
    assert [c["claim"][0] for c in claims] == ["1", "2", "3"]
    for claim in claims:
        assert claim["verdict"] in ("reproduced", "not reproduced", "inconclusive")
        assert f"**{claim['claim']}**: {claim['verdict']}" in report
        for stat in claim["statistics"].values():
            assert stat["seeds"] == 2
            assert stat["low"] - 1e-12 <= stat["estimate"] <= stat["high"] + 1e-12

    runs = {
        (c["name"], seed): read_metrics(out / "runs" / f"{c['name']}-seed{seed}" / "metrics.jsonl")
        for c in data["configurations"]
        for seed in data["seeds"]
    }
    for records in runs.values():
        ood = series(records, "eval/ood/pass@1")
        assert ood[min(ood)] > 0  # the held-out region is scored above 0 by the starting policy

    def final_id(name, seed):
        return final(runs[(name, seed)], "eval/id/pass@1")

    paired = [final_id("k1-reward-rtg-b1", s) - final_id("k3-loss-token-b1", s) for s in data["seeds"]]
    estimate = claims[1]["statistics"]["in-domain pass@1 (unbiased - biased)"]["estimate"]
    assert estimate == pytest.approx(sum(paired) / len(paired), abs=1e-12)
    for name in ("claim1", "claim2", "claim3", "final_id_vs_ood"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 1000
