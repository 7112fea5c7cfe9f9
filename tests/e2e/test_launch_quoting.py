"""Values from the config that end up in the generated Slurm scripts are data, never shell code: the
dry-run sbatch script and the trainer script of a heterogeneous (disaggregated SGLang) job are executed
under bash with srun / scontrol / torchrun / sleep / ps stubbed, with `;`, `$(...)`, backticks and quotes
in launch.slurm.env, launch.env, launch.rollout_servers.extra_args and trainer overrides; the server nodes join the
site's no_proxy."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nemo_run")

ROOT = Path(__file__).resolve().parents[2]
PAPER = str(ROOT / "configs" / "paper" / "qwen2.5-7b.yaml")
STUB = """#!/usr/bin/env bash
{{ printf '%s\\n' "--- $(basename "$0") EVIL=$EVIL TOKEN=$TOKEN URLS=$MEGATRON_KL_SGLANG_URLS KEY=$MEGATRON_KL_SGLANG_API_KEY NOPROXY=$no_proxy/$NO_PROXY"; printf '[%s]\\n' "$@"; }} >> {log}
"""


def _stubs(tmp: Path) -> dict:
    bin_dir, log = tmp / "bin", tmp / "calls.log"
    bin_dir.mkdir()
    for name in ("srun", "torchrun", "python"):
        (bin_dir / name).write_text(STUB.format(log=log))
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho node1\n")
    (bin_dir / "sleep").write_text("#!/usr/bin/env bash\n")
    (bin_dir / "ps").write_text("#!/usr/bin/env bash\nexit 1\n")  # every srun step has ended
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "node1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "node2",
        "NO_PROXY": "localhost,127.0.0.1",
    }  # a site's proxy exceptions (only the upper-case name set)
    env.pop("no_proxy", None)
    return {"env": env, "log": log}


def test_generated_slurm_scripts_run_no_injected_command(tmp_path):
    pwned = tmp_path / "pwned"
    evil = {
        "env": f"a; touch {pwned}-env",
        "token": f"$(touch {pwned}-subst)`touch {pwned}-tick`\"'",
        "arg": f"b; touch {pwned}-arg",
        "output": f"{tmp_path}/out $(touch {pwned}-override)",
    }
    overrides = [
        f"launch.home={tmp_path / 'home'}",
        f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}",
        "launch.slurm.account=acct",
        "launch.slurm.container_image=img",
        "rollout.sglang.colocated=false",
        "rollout.sglang.enable_memory_saver=false",
        "rollout.sglang.weight_sync=from_distributed",
        "launch.rollout_servers.mode=disaggregated",
        "launch.rollout_servers.model_path=/data/m",
        f"launch.slurm.env={{EVIL: {json.dumps(evil['env'])}}}",
        f"launch.env={{TOKEN: {json.dumps(evil['token'])}}}",
        f"launch.rollout_servers.extra_args=['--flag', {json.dumps(evil['arg'])}]",
        f"train.output_dir={evil['output']}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "launch", "slurm", "--config", PAPER, "--dryrun", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout[done.stdout.index("#!/bin/bash") :]
    sbatch, rest = text.split("\n# ---- train-0.sh (run by srun above)\n")
    server, trainer = rest.split("\n# ---- train-1.sh (run by srun above)\n")
    stubs = _stubs(tmp_path)
    urls = '"http://node1:30000"'  # what the sbatch script resolves for the server group (checked below)
    traces = {}
    for name, script in (("sbatch.sh", sbatch), ("train-0.sh", server), ("train-1.sh", trainer)):
        (tmp_path / name).write_text(script)
        env = dict(stubs["env"])
        if name != "sbatch.sh":  # what the srun steps inherit from the sbatch script
            env.update({"MEGATRON_KL_SGLANG_URLS": urls, "MEGATRON_KL_SGLANG_API_KEY": "c0ffee" * 10 + "beef"})
        run = subprocess.run(
            ["bash", str(tmp_path / name)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, (name, run.stderr[-3000:])
        traces[name] = run.stdout + run.stderr
    assert not list(tmp_path.glob("pwned*")), "a config value ran as a shell command"
    calls = stubs["log"].read_text()
    # every value arrived literally, as one argument / the variable's exact value
    assert f"EVIL={evil['env']} TOKEN={evil['token']} URLS={urls}" in calls  # srun steps of the sbatch script
    assert f"[{evil['arg']}]" in calls  # the SGLang server's argument
    assert f"[train.output_dir={evil['output']}]" in calls  # the trainer override
    assert f"[rollout.sglang.urls=[{urls}]]" in calls  # the intended expansions still work
    # the server nodes join the site's proxy exceptions (both spellings), so the trainer reaches them directly
    assert "NOPROXY=localhost,127.0.0.1,node1/localhost,127.0.0.1,node1" in calls, calls
    assert "[--api-key]\n[" + "c0ffee" * 10 + "beef]" in calls  # the server got the key its step inherits
    # the sbatch script made a random key for its steps, and its trace (set -x: the job's log) does not show it
    made = set(re.findall(r"KEY=([0-9a-f]{64})", calls)) - {"c0ffee" * 10 + "beef"}
    assert len(made) == 1, calls
    assert made.pop() not in traces["sbatch.sh"], "the API key is in the job's log"
    assert "xtrace" in traces["sbatch.sh"] or "+ " in traces["sbatch.sh"]  # the script does trace (set -x)


@pytest.mark.parametrize(
    "override, field",
    [
        ("launch.slurm.env={'BAD-NAME': x}", "launch.slurm.env"),
        ("launch.slurm.tunnel.job_dir=/tmp/a;b", "launch.slurm.tunnel.job_dir"),
    ],
)
def test_unquotable_launch_values_are_config_errors(tmp_path, override, field):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "launch",
            "slurm",
            "--config",
            PAPER,
            "--dryrun",
            f"launch.home={tmp_path}",
            "launch.slurm.account=acct",
            "launch.slurm.container_image=img",
            override,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 2 and field in done.stderr, done.stderr[-2000:]
