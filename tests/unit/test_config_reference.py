"""The configuration reference comes from the dataclasses; `train --check` validates without touching anything."""

import subprocess
import sys
from pathlib import Path

from megatron_kl.config_reference import field_docs, markdown, rows
from megatron_kl.config_reference import main as config_main
from megatron_kl.kl.objective import KLConfig
from megatron_kl.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "configs" / "cpu" / "default.yaml"


def test_every_field_is_listed_once_with_its_default_and_comment():
    listed = rows(TrainConfig)
    paths = [r[0] for r in listed]
    assert len(paths) == len(set(paths)) and "kl.estimator" in paths and "rollout.sglang.api_key_env" in paths
    by_path = {r[0]: r for r in listed}
    assert by_path["kl.coef"][2] == KLConfig().coef and "beta" in by_path["kl.coef"][4]
    assert field_docs(KLConfig)["clamp"].startswith("|log-ratio| bound")


def test_config_show_prints_values_and_marks_changes(capsys):
    assert config_main(["show", "--config", str(DEFAULT), "--section", "kl", "kl.coef=0.25"]) == 0
    out = capsys.readouterr().out
    assert "kl.coef" in out and "0.25   (default 0.001)" in out and "train.steps" not in out
    assert config_main(["show", "--section", "nosuch"]) == 2
    assert config_main(["show", "kl.estimator=k9"]) == 2
    assert "kl.estimator='k9' must be one of" in capsys.readouterr().err


def test_the_configuration_document_is_current():
    """docs/configuration.md is generated; regenerate with `megatron-kl config show --format md > docs/configuration.md`."""
    assert (ROOT / "docs" / "configuration.md").read_text() == markdown(TrainConfig, "Configuration reference")


def test_train_check_validates_prints_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "train",
            "--config",
            str(DEFAULT),
            "--check",
            f"train.output_dir={run}",
            "kl.estimator=k3",
            "kl.placement=loss",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (
        "estimator: k3" in ok.stdout and "# KL term: k3-loss-token" in ok.stdout and "# start: a new run" in ok.stdout
    )
    assert not run.exists()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "train",
            "--config",
            str(DEFAULT),
            "--check",
            f"train.output_dir={run}",
            "parallel.tensor_parallel=3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert bad.returncode == 2 and "parallel.tensor_parallel=3" in bad.stderr and not run.exists()


def test_the_metrics_document_is_current_and_families_match():
    """docs/metrics.md is generated: `python -m megatron_kl.train.metric_registry > docs/metrics.md`."""
    from megatron_kl.train.metric_registry import lookup, markdown

    assert (ROOT / "docs" / "metrics.md").read_text() == markdown()
    assert (
        lookup("eval/ood/mean@4").key == "eval/<split>/mean@<k>"
        and lookup("kl/exact_token").key == "kl/<estimator>_token"
    )
    assert lookup("kl/k3_tokens") is None and lookup("made/up") is None


def test_train_check_says_what_the_distillation_term_estimates(tmp_path):
    run = tmp_path / "run"
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "train",
            "--config",
            str(DEFAULT),
            "--check",
            f"train.output_dir={run}",
            "kl.estimator=k3",
            "distill.enabled=true",
            "distill.teacher.model.vocab_size=32",
            "distill.teacher.model.max_position_embeddings=32",
            "distill.kl.estimator=k1",
            "distill.kl.placement=reward",
            "distill.kl.level=token",
            "distill.kl.credit=immediate",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "# distillation term (to the teacher): k1-reward-token-imm: BIASED" in ok.stdout, ok.stdout[-800:]
    assert "# teacher: qwen2, 2 layers, hidden 64, in the student's layout" in ok.stdout, ok.stdout[-800:]
    assert not run.exists()
