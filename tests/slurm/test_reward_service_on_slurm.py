"""A verifier service as its own group of a heterogeneous Slurm job on the real cluster: the test verifier (node
mkl-n1) started by the job script from launch.reward_service.command, the trainer (mkl-n2) given its address as
reward.service.urls; the trainer scores every step through it, authenticated with a token from the submitting
environment that no log of the job shows."""

from __future__ import annotations

import json
import uuid

from tests.slurm.conftest import CONFIG, free_port
from tests.slurm.test_launch_on_slurm import (
    by_step,
    diagnosis,
    experiment_dir,
    experiment_id,
    job_id,
    job_state,
    wait_until,
)

STEPS = 3
# made at run time: the job's packaged code (a git archive of the checkout) holds this file, so a literal token here
# would be found in the job's directory by the check below
TOKEN = f"verifier-{uuid.uuid4().hex}"


def test_the_trainer_scores_through_a_verifier_running_as_a_group_of_its_job(slurm_cluster, warm_cache, tmp_path):
    run, port = tmp_path / "run", free_port()
    launched = slurm_cluster.launch(
        "slurm",
        "--cluster",
        "ci",
        "--config",
        CONFIG,
        "--detach",
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        f"train.steps={STEPS}",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "eval.interval=0",
        "task.eval_size=4",
        "eval.k=1",
        "checkpoint.interval=0",
        "logging.tensorboard=false",
        "launch.slurm.nodes=1",
        "reward.functions=[{name: service}]",
        "reward.service.token_env=LAB_VERIFIER_TOKEN",
        "launch.reward_service.mode=heterogeneous",
        f"launch.reward_service.port={port}",
        "launch.reward_service.command=[python, -m, megatron_kl.testing.reward_server, --host, 0.0.0.0, --port, "
        "'{port}', --token-env, LAB_VERIFIER_TOKEN]",
        env={"LAB_VERIFIER_TOKEN": TOKEN},
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    exp = experiment_id(launched.stdout)
    job = job_id(slurm_cluster, exp)
    explain = lambda: diagnosis(slurm_cluster, exp, job)  # noqa: E731
    wait_until(lambda: job_state(slurm_cluster, job) == "GONE", 400, "the job to finish", explain=explain)
    nodes = {row["job"]: row["nodes"] for row in slurm_cluster.sacct(job)}
    assert nodes.get(f"{job}+0") == "mkl-n1" and nodes.get(f"{job}+1") == "mkl-n2", nodes
    steps = by_step(run)
    assert sorted(steps)[:STEPS] == list(range(STEPS)), explain()
    # the service's own metric (the response length) reached every step: the rewards came from the verifier
    assert all(steps[s]["reward/extra/length"] >= 1 and steps[s]["reward/failed"] == 0 for s in range(STEPS))
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    config = (run / "config.yaml").read_text()
    assert f":{port}" in config and "mkl-n1" in config  # the address the job script resolved
    for log in experiment_dir(exp).rglob("*"):
        if log.is_file():
            assert TOKEN not in log.read_text(errors="replace"), log
    assert TOKEN not in (run / "metrics.jsonl").read_text() + config
