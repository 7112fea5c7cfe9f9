"""The lint rules and the format of ruff.toml hold over the repository (ruff, pinned in the test extra)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> str:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: pip install -e '.[test]'"
    return ruff


def test_ruff_finds_nothing():
    done = subprocess.run(
        [_ruff(), "check", "--no-cache", "--output-format", "concise", str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_every_file_is_formatted():
    """``ruff format`` would change nothing (run it to mend: ``ruff format .``)."""
    done = subprocess.run(
        [_ruff(), "format", "--check", "--no-cache", str(ROOT)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_format_check_sees_a_planted_unformatted_file(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("x = {  'a':1 }\n")
    done = subprocess.run(
        [_ruff(), "format", "--check", "--no-cache", "--config", str(ROOT / "ruff.toml"), str(planted)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "planted.py" in done.stdout


def test_the_lint_check_sees_a_planted_unused_import(tmp_path):
    ruff = _ruff()
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n")
    done = subprocess.run(
        [ruff, "check", "--no-cache", "--config", str(ROOT / "ruff.toml"), str(planted)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "F401" in done.stdout
