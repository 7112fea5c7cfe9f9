"""A key planted through every path a user can pass one reaches no file, log or terminal line the project writes:
a secret flag of the servers (``rollout.sglang.extra_args``), the managed servers' key (its environment variable),
a reward function's keyword argument, ``launch.env``, a secret environment variable a reward function prints, and a
URL's password. ``--api-key`` in the servers' extra_args is refused (the key has its own variable), and a launch
that would write a secret flag's value into a job script is refused, both without repeating the value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_kl.rollout.servers import server_port
from tests.e2e.runs import DEFAULT, ROOT
from tests.e2e.test_sglang import TEST_SERVER

KEYS = {name: f"planted-{name}-7f3a9c1e" for name in ("flag", "managed", "kwarg", "launch_env", "environment", "url")}
REWARD = """
import os, sys

def keyed(sample, api_key, endpoint):
    assert api_key == "{kwarg}", "the reward function did not get its key"
    print(f"reward call with key {{api_key}} from {{endpoint}}, token {{os.environ['VERIFIER_TOKEN']}}", file=sys.stderr)
    return 1.0 if sample.response.strip() == str(sample.answer) else 0.0
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


def _cli(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", *args],
        cwd=ROOT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _leaks(root: Path, *texts: str) -> list[str]:
    found = []
    for path in [p for p in root.rglob("*") if p.is_file()]:
        if path.suffix == ".py":  # the test's own reward file holds its key
            continue
        data = path.read_bytes()
        found += [f"{path}: {name}" for name, key in KEYS.items() if key.encode() in data]
    for i, text in enumerate(texts):
        found += [f"output {i}: {name}" for name, key in KEYS.items() if key in text]
    return found


def test_a_key_planted_through_every_path_is_written_nowhere(tmp_path, warm_cache):
    reward_file = tmp_path / "keyed_reward.py"
    reward_file.write_text(REWARD.format(**KEYS))
    run = tmp_path / "run"
    overrides = [
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        "train.steps=2",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=0",
        "checkpoint.interval=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "rollout.engine=sglang",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        f"rollout.sglang.sync_dir={tmp_path / 'sync'}",
        f"rollout.sglang.extra_args=[--admin-api-key, {KEYS['flag']}]",
        f"reward.functions=[{{name: '{reward_file}:keyed', kwargs: {{api_key: {KEYS['kwarg']}, "
        f"endpoint: 'http://user:{KEYS['url']}@verifier:8000/score'}}}}]",
        f"launch.env={{HF_TOKEN: {KEYS['launch_env']}}}",
    ]
    env = _env(MEGATRON_KL_SGLANG_API_KEY=KEYS["managed"], VERIFIER_TOKEN=KEYS["environment"])
    check = _cli("train", "--config", str(DEFAULT), "--check", *overrides, env=env)
    assert check.returncode == 0, check.stderr[-3000:]
    done = _cli("train", "--config", str(DEFAULT), *overrides, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward call with key <redacted> from http://user:<redacted>@verifier" in done.stderr, done.stderr[-3000:]
    assert "<redacted>" in (run / "config.yaml").read_text()
    server_logs = list(run.rglob("sglang-*.log"))
    assert server_logs and "--admin-api-key <redacted>" in server_logs[0].read_text()
    assert _leaks(tmp_path, check.stdout, check.stderr, done.stdout, done.stderr) == []


def test_secret_flags_that_would_be_written_are_refused_without_the_value(tmp_path):
    api_key = _cli(
        "train",
        "--config",
        str(DEFAULT),
        "--check",
        f"train.output_dir={tmp_path / 'run'}",
        "rollout.engine=sglang",
        f"rollout.sglang.extra_args=[--api-key, {KEYS['flag']}]",
    )
    assert api_key.returncode == 2 and "rollout.sglang.extra_args passes --api-key" in api_key.stderr, api_key.stderr
    assert "MEGATRON_KL_SGLANG_API_KEY" in api_key.stderr
    launch = _cli(
        "launch",
        "slurm",
        "--config",
        str(DEFAULT),
        "--dryrun",
        f"launch.home={tmp_path / 'home'}",
        f"train.output_dir={tmp_path / 'run'}",
        f"launch.rollout_servers.extra_args=[--admin-api-key={KEYS['flag']}]",
    )
    assert launch.returncode == 2, launch.stderr[-2000:]
    assert "launch.rollout_servers.extra_args gives --admin-api-key a value" in launch.stderr, launch.stderr[-2000:]
    assert _leaks(tmp_path, api_key.stdout, api_key.stderr, launch.stdout, launch.stderr) == []
