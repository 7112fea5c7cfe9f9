"""No process a command starts outlives it: the ranks ``megatron_kl.local_ranks.run_ranks`` starts (those of
``megatron-kl convert``, and the fork server they come from) die when their command is killed -9, even in the middle
of their work. (The study's trainers: tests/e2e/test_study_stops.py; the trainer's servers and forked helpers:
tests/e2e/test_signals.py.)"""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def sleeper(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def test_a_killed_command_leaves_no_rank_behind(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    marker = tmp_path / "started"
    script = (
        "import pathlib; from megatron_kl.local_ranks import run_ranks; "
        "from tests.e2e.test_children_die_with_their_parent import sleeper; "
        f"pathlib.Path('{marker}').touch(); run_ranks(sleeper, 2, 300.0, timeout_s=600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env)
    command = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while True:  # both ranks started (under the fork server, or spawned)
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started"
        children = command.children(recursive=True)
        ranks = [c for c in children if c.ppid() != proc.pid or "spawn" in " ".join(c.cmdline())]
        if marker.exists() and len(ranks) >= 2:
            break
        time.sleep(0.05)
    time.sleep(2)  # in their work
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [(p.pid, p.cmdline()[-1][:80]) for p in alive]


def test_a_killed_local_launch_stops_its_trainers_with_a_checkpoint(tmp_path, warm_cache):
    """``megatron-kl launch local`` killed -9 mid-run: torchrun and both ranks end within moments, the finished steps
    saved (the trainers take its death as SIGTERM), and the same launch resumes from them."""
    from megatron_kl.run.checkpoint import complete_checkpoints
    from megatron_kl.train.metrics import read_metrics

    out, home = tmp_path / "out", tmp_path / "home"
    args = [
        sys.executable,
        "-m",
        "megatron_kl.cli",
        "launch",
        "local",
        "--config",
        "configs/cpu/default.yaml",
        "train.steps=40",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=0",
        "checkpoint.interval=0",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"warm_start.cache_dir={warm_cache}",
        f"train.output_dir={out}",
        f"launch.home={home}",
        "parallel.tensor_parallel=2",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    launcher = psutil.Process(proc.pid)
    deadline = time.monotonic() + 600

    def steps():
        path = out / "metrics.jsonl"
        return [r["step"] for r in read_metrics(path) if "reward/mean" in r] if path.is_file() else []

    while len(steps()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the launch ended before two steps"
        time.sleep(0.2)
    children = launcher.children(recursive=True)
    assert sum("megatron_kl.cli" in " ".join(c.cmdline()) for c in children) >= 2, [c.cmdline() for c in children]
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=120)
    assert not alive, [(p.pid, " ".join(p.cmdline())[:100]) for p in alive]
    saved = complete_checkpoints(out / "checkpoints")
    assert saved, "the trainers stopped without saving their finished steps"
    assert len(steps()) < 40
