"""A damaged or planted checkpoint is never resumed from and never runs code: every file is checked against
the checkpoint's manifest before anything is read, and what is read goes through restricted unpicklers.

One base run writes checkpoints at steps 1 and 2; each case damages step 2 of a copy of it and resumes: the
run must name the damaged file, fall back to step 1 and finish, with no marker file from a planted pickle."""

import os
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

from megatron_kl.run import manifest
from megatron_kl.run.checkpoint import MARKER
from tests.e2e.runs import DEFAULT, Run


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _args(run: Path, cache: str, steps: int) -> list[str]:
    return [
        "--config",
        str(DEFAULT),
        f"train.output_dir={run}",
        f"warm_start.cache_dir={cache}",
        f"train.steps={steps}",
        "checkpoint.interval=1",
        "checkpoint.keep=3",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, warm_cache):
    root = tmp_path_factory.mktemp("integrity")
    cache = warm_cache
    code, output = Run(root / "base.log", *_args(root / "base", cache, 2)).wait()
    assert code == 0, output[-3000:]
    return root / "base", cache


def _resign(checkpoint: Path, step: int = 2) -> None:
    """What someone who can write the directory can do: a manifest and marker that match the new bytes."""
    (checkpoint / manifest.MANIFEST).unlink()
    digest = manifest.write_manifest(checkpoint, MARKER)
    (checkpoint / MARKER).write_text(manifest.marker_text(step, digest))


def _largest_shard(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _overwrite_middle(path: Path, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + len(data)] = data
    path.write_bytes(bytes(raw))


def flip_64_bits(ckpt):
    shard = _largest_shard(ckpt)
    raw = bytearray(shard.read_bytes())
    rng = random.Random(0)
    for position in rng.sample(range(len(raw) // 4, 3 * len(raw) // 4), 64):
        raw[position] ^= 1 << rng.randrange(8)
    shard.write_bytes(bytes(raw))
    return shard.name, "does not match its SHA-256"


def zeros_4k(ckpt):
    shard = _largest_shard(ckpt)
    _overwrite_middle(shard, bytes(4096))
    return shard.name, "does not match its SHA-256"


def random_4k(ckpt):
    shard = _largest_shard(ckpt)
    _overwrite_middle(shard, random.Random(1).randbytes(4096))
    return shard.name, "does not match its SHA-256"


def truncated_shard(ckpt):
    shard = _largest_shard(ckpt)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard.name, "bytes, the manifest says"


def zeroed_trainer_file(ckpt):
    path = ckpt / "trainer.pt"
    path.write_bytes(bytes(path.stat().st_size))
    return "trainer.pt", "does not match its SHA-256"


def planted_file(ckpt):
    (ckpt / "extra.pt").write_bytes(b"x")
    return "extra.pt", "is not in MANIFEST.json"


def edited_manifest(ckpt):
    path = ckpt / manifest.MANIFEST
    path.write_text(path.read_text().replace('"size"', '"size" ', 1))
    return manifest.MANIFEST, "does not match the digest"


def edited_run_record(ckpt):
    """Still valid JSON, with another identity: compared before verification it read as a configuration change."""
    path = ckpt / "run.json"
    path.write_text(path.read_text().replace('"kl.coef": 0.01', '"kl.coef": 0.02', 1))
    return "run.json", "does not match its SHA-256"


DAMAGES = [
    flip_64_bits,
    zeros_4k,
    random_4k,
    truncated_shard,
    zeroed_trainer_file,
    planted_file,
    edited_manifest,
    edited_run_record,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(tmp_path, base_run, damage):
    base, cache = base_run
    run = tmp_path / "run"
    shutil.copytree(base, run)
    name, message = damage(run / "checkpoints" / "step_000002")
    code, output = Run(tmp_path / "resume.log", *_args(run, cache, 3)).wait()
    assert code == 0, output[-3000:]
    line = next((row for row in output.splitlines() if "trying the previous checkpoint" in row), "")
    assert name in line and message in line, output[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000001'} at RL step 1" in output, output[-3000:]
    import json

    starts = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines()]
    assert starts[-1]["kind"] == "resume" and starts[-1]["from_step"] == 1, starts  # the step actually loaded


def test_a_checkpoint_renamed_to_a_later_step_is_not_resumed_at_that_step(tmp_path, base_run):
    base, cache = base_run
    run = tmp_path / "run"
    shutil.copytree(base, run)
    (run / "checkpoints" / "step_000002").rename(run / "checkpoints" / "step_000005")
    code, output = Run(tmp_path / "resume.log", *_args(run, cache, 3)).wait()
    assert code == 0, output[-3000:]
    assert "step_000005: its COMPLETE records step 2, not the step 5 of its name" in output, output[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000001'} at RL step 1" in output, output[-3000:]


def test_a_pickle_planted_in_any_file_never_runs(tmp_path, warm_cache):
    """Each file name of a checkpoint replaced by a code-running pickle AND the manifest re-signed to match it
    (what a writer of the directory could do), one file per checkpoint from the newest down: the restricted
    loaders refuse each, the run falls back through all of them to the one clean checkpoint, and no payload's
    marker ever appears. One resume walks the whole chain."""
    run, steps = tmp_path / "run", 10
    code, output = Run(tmp_path / "base.log", *_args(run, warm_cache, steps), f"checkpoint.keep={steps}").wait()
    assert code == 0, output[-3000:]
    newest = run / "checkpoints" / f"step_{steps:06d}"
    files = sorted(p.name for p in newest.iterdir() if p.name not in (MARKER, manifest.MANIFEST))
    assert {".metadata", "trainer.pt", "common.pt", "rank_00000.pt"} <= set(files)
    assert len(files) < steps, files
    markers = []
    for offset, name in enumerate(files):
        checkpoint = run / "checkpoints" / f"step_{steps - offset:06d}"
        markers.append(tmp_path / f"pwned-{name}")
        target = checkpoint / name
        if name.endswith(".pt"):
            torch.save({"state": Payload(markers[-1])}, target)  # a torch zip archive with the payload inside
        else:
            target.write_bytes(pickle.dumps(Payload(markers[-1])))
        _resign(checkpoint, steps - offset)
    code, output = Run(tmp_path / "resume.log", *_args(run, warm_cache, steps + 1), f"checkpoint.keep={steps}").wait()
    assert not [m.name for m in markers if m.exists()], "a planted pickle was executed"
    assert code == 0, output[-3000:]
    refused = [line for line in output.splitlines() if "trying the previous checkpoint" in line]
    for offset, name in enumerate(files):  # each planted checkpoint refused, the message naming the planted file
        step_dir = f"step_{steps - offset:06d}"
        assert any(f"{step_dir}:" in line and f"{step_dir}/{name}" in line for line in refused), (name, refused)
    clean = run / "checkpoints" / f"step_{steps - len(files):06d}"
    assert f"resumed from {clean} at RL step {steps - len(files)}" in output, output[-3000:]
