"""A user script that calls the trainer at module level (no ``if __name__ == "__main__":`` guard) runs once
and saves its checkpoints: megatron's checkpoint writer must not re-import ``__main__`` (spawn) on save."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os
print("START", os.getpid(), flush=True)
from megatron_kl.train.cli import single_process_env
from megatron_kl.train.config import load_train_config
from megatron_kl.train.loop import train
cfg = load_train_config({config!r}, ["train.steps=2", "checkpoint.interval=1", "train.output_dir={out}",
    "warm_start.enabled=false", "eval.interval=0", "logging.progress=false", "logging.tensorboard=false",
    "train.prompts_per_step=4", "train.group_size=2", "task.eval_size=4", "eval.k=1"])
single_process_env()
train(cfg)
print("DONE", flush=True)
"""


def test_trainer_called_without_main_guard_runs_once(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT.format(config=str(ROOT / "configs" / "cpu" / "default.yaml"), out=tmp_path / "run"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert output.count("START") == 1 and "DONE" in output, output[-3000:]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
