"""What `megatron-kl train` prints while it trains: to a file (a batch job's log) one line per step as it happens, to
an 80-column pseudo-terminal one readable bar; the total wall time at the end either way."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "train.steps=3",
    "train.prompts_per_step=4",
    "train.group_size=2",
    "task.eval_size=4",
    "eval.k=1",
    "eval.interval=0",
    "checkpoint.interval=0",
    "logging.tensorboard=false",
    "logging.progress=true",
    "warm_start.enabled=false",
]  # what is printed, not what is learnt: no supervised phase to wait for


def _command(tmp_path, name):
    return [
        sys.executable,
        "-m",
        "megatron_kl.cli",
        "train",
        "--config",
        str(ROOT / "configs/cpu/default.yaml"),
        *SMALL,
        f"train.output_dir={tmp_path / name}",
        f"warm_start.cache_dir={tmp_path / 'cache'}",
    ]


def test_a_log_file_gets_a_line_per_step_and_the_total_time(tmp_path):
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        done = subprocess.run(_command(tmp_path, "file"), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    steps = re.findall(r"megatron_kl.train: (step \d/3 .*)", text)
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"], text[-2000:]
    assert all(
        "reward " in s and "kl/exact " in s and "s/step" in s and "tokens/s" in s and "remaining" in s for s in steps
    ), steps
    assert re.search(r"trained steps 0-2 of 3 in \d:\d\d:\d\d", text)
    assert "━" not in text  # no progress bar frames in a file


def test_an_80_column_terminal_gets_one_bar_that_fits(tmp_path):
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        _command(tmp_path, "tty"), stdin=child, stdout=child, stderr=child, cwd=ROOT, env=env, close_fds=True
    )
    os.close(child)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 600)
        if not ready:
            break
        try:
            data = os.read(main, 65536)
        except OSError:  # the child side closed
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(main)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n")
    bars = [line for line in plain.splitlines() if "━" in line]
    assert bars, plain[-2000:]
    assert all(len(line) <= 80 for line in bars), bars
    assert "3/3" in bars[-1] and "reward " in bars[-1] and "kl " in bars[-1] and "…" not in bars[-1], bars[-1]
    assert re.search(r"trained steps 0-2 of 3 in \d:\d\d:\d\d", plain)
