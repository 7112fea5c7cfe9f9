"""Disaggregated rollouts as a heterogeneous Slurm job on the real cluster: the SGLang test server in one component
(node mkl-n1), the trainer in the other (mkl-n2), the server's address resolved by the sbatch script. The trainer
waits for the server's health and trains from it; the server's process killed mid-run makes the trainer checkpoint
its finished steps and exit with the requeue code; the job requeues, both components start again, the trainer
resumes and the job completes with every step logged. The job runs with a site's HTTP proxy in its environment:
the trainer reaches the server directly (the job script adds the server nodes to no_proxy)."""

from __future__ import annotations

import json
import re
import signal
import sys

import psutil

from megatron_kl.run import checkpoint
from megatron_kl.run.preemption import REQUEUE_EXIT_CODE
from megatron_kl.testing.site_proxy import SiteProxy
from tests.slurm.conftest import CONFIG, ROOT, free_port
from tests.slurm.test_launch_on_slurm import (
    by_step,
    diagnosis,
    experiment_dir,
    experiment_id,
    job_id,
    job_state,
    settled_starts,
    start_requeued_now,
    steps_done,
    wait_until,
)

sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from hf_workers import make_hf_model  # noqa: E402

TEST_SERVER = "megatron_kl.testing.sglang_server"
# the model of the HF checkpoint the server starts from and the trainer initialises from (tests/e2e/test_train.py)
MODEL = [
    "model.architecture=qwen3",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.ffn_hidden_size=96",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.kv_channels=24",
    "model.vocab_size=61",
    "model.tie_word_embeddings=true",
    "model.rope_theta=1000000.0",
    "model.norm_epsilon=1e-6",
]
STEPS = 6


def _server_processes(port: int) -> list:
    """The test server's processes of this job (its port is the test's own free port); not srun."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if TEST_SERVER in command and f"--port {port}" in command and not command.startswith("srun"):
            found.append(process)
    return found


def _logs(exp: str, job: str, group: int, restart: int) -> str:
    """The log of one component's start: NeMo-Run names it by the component's own job id (``job`` + ``group``)."""
    found = list(experiment_dir(exp).rglob(f"log-megatron-kl.train-{group}_{int(job) + group}_{restart}.out"))
    assert found, f"no log of group {group}, start {restart}"
    return found[0].read_text(errors="replace")


def test_the_trainer_and_the_sglang_server_run_as_a_heterogeneous_job(slurm_cluster, warm_cache, tmp_path):
    source = make_hf_model("qwen3", tmp_path / "qwen3")
    run, port = tmp_path / "run", free_port()
    proxy = SiteProxy(free_port())  # a site's proxy in the job's environment, nothing in no_proxy
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
        "launch.rollout_servers.mode=disaggregated",
        f"launch.rollout_servers.port={port}",
        "rollout.engine=sglang",
        f"rollout.sglang.server_module={TEST_SERVER}",
        "rollout.sglang.colocated=false",
        "rollout.sglang.enable_memory_saver=false",
        "rollout.sglang.weight_sync=from_disk",
        "rollout.sglang.max_retries=1",
        "rollout.sglang.backoff_s=0.05",
        f"init.hf_checkpoint={source}",
        *MODEL,
        env=proxy.environment(),
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    exp = experiment_id(launched.stdout)
    job = job_id(slurm_cluster, exp)
    explain = lambda: diagnosis(slurm_cluster, exp, job)  # noqa: E731
    wait_until(lambda: steps_done(run) >= 2, 300, "two steps trained from the server", interval=0.2, explain=explain)
    nodes = {row["job"]: row["nodes"] for row in slurm_cluster.sacct(job)}
    assert nodes.get(f"{job}+0") == "mkl-n1" and nodes.get(f"{job}+1") == "mkl-n2", nodes  # one component a node
    trainer = _logs(exp, job, 1, 0)
    assert "mkl-n1" in trainer and "is healthy" in trainer, trainer[-3000:]  # the address the job script resolved

    servers = wait_until(lambda: _server_processes(port), 30, "the server's process", explain=explain)
    for process in servers:  # the server's component dies (its process; srun then ends the component's step)
        process.send_signal(signal.SIGKILL)
    wait_until(
        lambda: f"exit code {REQUEUE_EXIT_CODE}" in _logs(exp, job, 1, 0), 120, "the trainer to stop", explain=explain
    )
    trainer = _logs(exp, job, 1, 0)
    assert "rollout engine lost" in trainer, trainer[-3000:]
    stopped_at = len(by_step(run))  # steps 0 .. stopped_at - 1 logged, and checkpointed
    assert 1 <= stopped_at < STEPS, trainer[-3000:]
    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == [f"step_{stopped_at:06d}"]

    # the job script sees a component fail and requeues the job (launch.slurm.retries=1): both components again
    def pending() -> bool:  # squeue lists a het job once per component
        return set(job_state(slurm_cluster, job).split()) == {"PENDING"}

    wait_until(
        lambda: pending() or job_state(slurm_cluster, job) == "GONE", 120, "the job to requeue itself", explain=explain
    )
    start_requeued_now(slurm_cluster, job, components=2)
    wait_until(lambda: job_state(slurm_cluster, job) == "GONE", 400, "the requeued job to finish", explain=explain)
    # sacct names a het job's starts by its first component
    assert settled_starts(slurm_cluster, job, f"{job}+0") == ["REQUEUED", "COMPLETED"], slurm_cluster.sacct(
        job, duplicates=True
    )
    assert sorted(by_step(run))[:STEPS] == list(range(STEPS))
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    lines = (run / "starts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1]).get("kind") == "resume", lines
    assert "is healthy" in _logs(exp, job, 1, 1)
    assert not _server_processes(port), "the server outlived its job"
    assert proxy.seen == [], proxy.seen  # the trainer reached its servers directly, not through the site's proxy
    proxy.close()
    # the job's log (NeMo-Run traces its script) does not show the servers' API key
    for log in experiment_dir(exp).rglob("*.out"):
        assert not re.search(r"API_KEY=[0-9a-f]{16}|--api-key [0-9a-f]{16}", log.read_text(errors="replace")), log
