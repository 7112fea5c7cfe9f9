"""The commands the docs mark runnable are run: a fenced block after ``<!-- smoke -->`` (or ``<!-- smoke: overrides
-->``, appended to each ``megatron-kl train`` line to keep it small) must exit 0. Outputs go to a temporary
directory, never to runs/."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SMOKE = re.compile(r"<!-- smoke(?::([^>]*))? -->\s*```[a-z]*\n(.*?)```", re.S)


def runnable_commands() -> list[tuple[str, list[str], list[str]]]:
    """(page, command words, extra overrides) of every marked block's ``.venv/bin/megatron-kl`` line."""
    out = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for overrides, block in _SMOKE.findall(page.read_text()):
            for line in block.strip().splitlines():
                words = shlex.split(line)
                assert words[0] == ".venv/bin/megatron-kl", f"{page.name}: a smoke block runs megatron-kl only: {line}"
                out.append((page.name, words[1:], shlex.split(overrides or "")))
    return out


def test_the_docs_runnable_commands_run(tmp_path):
    commands = runnable_commands()
    assert len(commands) >= 4, commands  # the marked blocks were found
    for i, (page, words, overrides) in enumerate(commands):
        if words[0] == "train":
            words = (
                words
                + overrides
                + [f"train.output_dir={tmp_path / f'run{i}'}", f"warm_start.cache_dir={tmp_path / 'cache'}"]
            )
        done = subprocess.run(
            [sys.executable, "-m", "megatron_kl.cli", *words], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (
            f"{page}: megatron-kl {shlex.join(words)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    trained = [i for i, (_, words, _) in enumerate(commands) if words[0] == "train" and "--check" not in words]
    assert trained and all((tmp_path / f"run{i}" / "summary.json").is_file() for i in trained)
