"""Checkpoint write failures are said plainly: a full disk with the path and the space needed."""

import errno
import shutil
from collections import namedtuple

from megatron_kl.train import checkpoint

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
    for err in (OSError(errno.ENOSPC, "No space left on device"),
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")):
        message = checkpoint._write_error(err, tmp, 3 << 20, 3)
        assert message.startswith("no space left on device writing the checkpoint of step 3") and str(tmp) in message
        assert "3.0 MiB" in message and "0.0 MiB free" in message
    other = checkpoint._write_error(PermissionError(errno.EACCES, "Permission denied"), tmp, 0, 3)
    assert "failed: PermissionError" in other and "no space" not in other
