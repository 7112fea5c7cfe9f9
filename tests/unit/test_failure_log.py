"""The failure-log plugin names a failing test in its file while the run is still going."""

import os
import subprocess
import sys

import pytest


# started from a test that runs in a pytest-xdist worker (PYTEST_XDIST_WORKER inherited): still a controller
@pytest.mark.parametrize("inherited", [{}, {"PYTEST_XDIST_WORKER": "gw3"}], ids=["plain", "inside_an_xdist_worker"])
def test_a_failing_test_is_written_with_its_traceback_and_a_passing_one_is_not(tmp_path, inherited):
    (tmp_path / "test_planted.py").write_text(
        "def test_fails():\n    assert 2 + 2 == 5, 'planted'\n\ndef test_passes():\n    assert True\n"
    )
    log = tmp_path / "failures.txt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "megatron_kl.testing.failure_log",
            "--failure-log",
            str(log),
            str(tmp_path / "test_planted.py"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **inherited},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    text = log.read_text()
    assert "test_planted.py::test_fails [call]" in text and "planted" in text
    assert "test_passes" not in text
