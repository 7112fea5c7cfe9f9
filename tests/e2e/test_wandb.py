"""Weights & Biases tracking with the real wandb package in offline mode: a short run writes its W&B run under the
run directory, keyed by the run's id, with the resolved config (secrets redacted) and the step metrics; without the
package, --check refuses the configuration naming the extra to install."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kl.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "cpu" / "default.yaml")


def wandb_records(path: Path):
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte ``:W&B`` header, then LevelDB's log format
    (32 KiB blocks of chunks with a 7-byte header: checksum, length, type FULL / FIRST / MIDDLE / LAST) whose payloads
    are ``wandb_internal_pb2.Record`` messages. wandb 0.31 keeps no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def test_a_run_tracked_offline_writes_its_config_and_metrics(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_kl.cli",
                "train",
                "--config",
                CONFIG,
                "train.steps=2",
                "train.prompts_per_step=4",
                "train.group_size=2",
                "task.eval_size=4",
                "eval.k=1",
                "eval.interval=0",
                "checkpoint.interval=0",
                "logging.progress=false",
                "logging.tensorboard=false",
                f"train.output_dir={run}",
                f"warm_start.cache_dir={tmp_path / 'cache'}",
                "warm_start.enabled=false",
                "logging.wandb_project=megatron-kl-ci",
                "logging.wandb_mode=offline",
                "logging.wandb_tags=[ci, offline]",
                "launch.env={WANDB_API_KEY: not-a-real-key}",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
            env={**os.environ, "WANDB_SILENT": "true"},
        )
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    run_id = json.loads(next((run / "checkpoints").glob("step_*/run.json")).read_text())["run_id"]
    offline = list((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1, sorted(p.name for p in (run / "wandb").iterdir())
    records = list(wandb_records(next(offline[0].glob("run-*.wandb"))))
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run_record.run_id, run_record.project, list(run_record.tags)) == (
        run_id,
        "megatron-kl-ci",
        ["ci", "offline"],
    )
    assert run_record.display_name.startswith("full-loss-token-coef0.01-grpo-ppo-s0-seed1234-")
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["kl"]["estimator"] == "full" and config["train"]["steps"] == 2
    assert config["launch"]["env"]["WANDB_API_KEY"] == "<redacted>"
    history = [
        (
            r.history.step.num,
            {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item},
        )
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    steps = [(step, h) for step, h in history if "reward/mean" in h]
    assert [step for step, _ in steps] == [0, 1] and all("kl/exact_token" in h for _, h in steps), history


def test_check_refuses_wandb_when_the_package_is_missing(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", "--config", CONFIG, "--check", "logging.wandb_project=lab"]) == 2
    err = capsys.readouterr().err
    assert "logging.wandb_project='lab' needs the wandb package" in err and "pip install 'megatron-kl[wandb]'" in err
