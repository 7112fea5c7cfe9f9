"""Checkpoint write failures are said plainly: a full disk with the path and the space needed."""

import errno
import shutil
from collections import namedtuple

from megatron_kl.run import checkpoint

Usage = namedtuple("Usage", "total used free")


def test_too_little_space_for_the_next_checkpoint_is_refused_naming_path_and_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 << 20, 99 << 20, 1 << 20))
    message = checkpoint._no_space(tmp_path, 8 << 20, 7)
    assert "no space left on device" in message and str(tmp_path) in message
    assert "8.0 MiB" in message and "1.0 MiB are free" in message and "step 7" in message
    assert checkpoint._no_space(tmp_path, 512 << 10, 7) is None  # fits
    assert checkpoint._no_space(tmp_path, 0, 1) is None  # first checkpoint: nothing to go by


def test_a_full_disk_during_the_write_is_named_as_such(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 << 20, 100 << 20, 0))
    tmp = tmp_path / "step_000003.tmp"
    for err in (
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
    ):
        message = checkpoint._write_error(err, tmp, 3 << 20, 3)
        assert message.startswith("no space left on device writing the checkpoint of step 3") and str(tmp) in message
        assert "3.0 MiB" in message and "0.0 MiB free" in message
    other = checkpoint._write_error(PermissionError(errno.EACCES, "Permission denied"), tmp, 0, 3)
    assert "failed: PermissionError" in other and "no space" not in other


def test_free_before_write_deletes_this_runs_oldest_checkpoints_until_the_next_fits(tmp_path, monkeypatch):
    import json

    def make(step, run_id):
        path = tmp_path / f"step_{step:06d}"
        path.mkdir()
        (path / "weights").write_bytes(b"\0" * (1 << 20))
        (path / checkpoint.RUN_FILE).write_text(json.dumps({"run_id": run_id, "identity": {}}))
        (path / checkpoint.MARKER).write_text(f"step {step}\nmanifest-sha256 0\n")

    for step, run_id in ((1, "other"), (2, "mine"), (3, "mine"), (4, "mine"), (5, "mine")):
        make(step, run_id)
    used = lambda: sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())  # noqa: E731
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(6 << 20, used(), (6 << 20) - used()))
    assert checkpoint._no_space(tmp_path, int(2.5 * (1 << 20)), 6)  # 1 MiB free, about 2.6 needed
    checkpoint._free_space(tmp_path, int(2.5 * (1 << 20)), 6, "mine")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step_000001", "step_000004", "step_000005"], left  # two of mine, oldest first; not the other run's
    checkpoint._free_space(tmp_path, 20 << 20, 6, "mine")  # never fits: the newest is kept all the same
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000005"]
    message = checkpoint._no_space(tmp_path, 20 << 20, 6)
    assert "checkpoint.free_before_write=true" in message and "lower checkpoint.keep" not in message


def test_a_checkpoint_whose_marker_records_another_step_is_not_used(tmp_path, caplog):
    for step, recorded in ((2, 2), (4, 4), (9, 4)):  # step_000009 is a copy of step_000004
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / checkpoint.MARKER).write_text(f"step {recorded}\nmanifest-sha256 0\n")
    with caplog.at_level("WARNING"):
        found = checkpoint.complete_checkpoints(tmp_path)
    assert [p.name for p in found] == ["step_000002", "step_000004"]
    assert "step_000009" in caplog.text and "records step 4" in caplog.text
