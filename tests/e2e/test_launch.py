"""`megatron-kl launch` through NeMo-Run: a real local experiment (2 gloo ranks under torchrun), a failing task
that makes the launcher exit non-zero with its log, a study as one experiment, and Slurm dry runs whose
sbatch scripts are checked against the config (no cluster needed)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("nemo_run")

ROOT = Path(__file__).resolve().parents[2]
BASE = str(ROOT / "configs" / "cpu" / "default.yaml")
PAPER = str(ROOT / "configs" / "paper" / "qwen2.5-7b.yaml")
SMALL = [
    "train.steps=2",
    "train.prompts_per_step=8",
    "train.group_size=4",
    "task.eval_size=8",
    "eval.k=2",
    "eval.interval=0",
    "checkpoint.interval=0",
    "logging.tensorboard=false",
]


def _launch(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_local_two_rank_training_and_status(tmp_path, warm_cache):
    out, home = tmp_path / "out", tmp_path / "home"
    done = _launch(
        "local",
        "--config",
        BASE,
        *SMALL,
        f"warm_start.cache_dir={warm_cache}",
        f"train.output_dir={out}",
        f"launch.home={home}",
        "parallel.tensor_parallel=2",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "train: SUCCEEDED" in done.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "step" in m and "loss/total" in m]
    assert [m["step"] for m in steps] == [0, 1]
    # the run really had two ranks: its saved config says so and torchelastic kept one log per rank
    exp_id = re.search(r"^experiment: (\S+)", done.stdout, re.M).group(1)
    rank_logs = list(home.rglob("attempt_0/*/stderr.log"))
    assert len(rank_logs) == 2
    status = _launch("status", exp_id, "--home", str(home))
    assert status.returncode == 0 and "train: SUCCEEDED" in status.stdout
    logs = _launch("logs", exp_id, "--home", str(home))
    assert "megatron_kl.train" in logs.stdout


def test_failing_task_exits_nonzero_with_its_log(tmp_path, warm_cache):
    done = _launch(
        "local",
        "--config",
        BASE,
        *SMALL,
        f"warm_start.cache_dir={warm_cache}",
        f"train.output_dir={tmp_path / 'out'}",
        f"launch.home={tmp_path / 'home'}",
        f"init.hf_checkpoint={tmp_path / 'missing'}",
    )
    assert done.returncode == 1
    assert "task train ended FAILED" in done.stderr
    assert "init.hf_checkpoint=" in done.stderr and "names no directory" in done.stderr  # the task's own error


def test_study_as_one_experiment_reports_failed_run(tmp_path, warm_cache):
    study = {
        "name": "ci-launch",
        "base": BASE,
        "output_dir": str(tmp_path / "study"),
        "seeds": [1],
        "common": [*SMALL, f"warm_start.cache_dir={warm_cache}", f"launch.home={tmp_path / 'home'}"],
        "configurations": [
            {"name": "k3-loss", "overrides": ["kl.estimator=k3"]},
            {"name": "broken", "overrides": [f"init.hf_checkpoint={tmp_path / 'missing'}"]},
        ],
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    done = _launch("local", "--config", str(path))
    assert done.returncode == 1
    assert "k3-loss-seed1: SUCCEEDED" in done.stdout and "broken-seed1: FAILED" in done.stdout
    status = json.loads((tmp_path / "study" / "status.json").read_text())
    assert status["k3-loss-seed1"]["state"] == "ok" and status["broken-seed1"]["state"] == "failed"
    report = (tmp_path / "study" / "report.md").read_text()
    assert "### broken-seed1" in report and "names no directory" in report


SLURM = [
    "launch.slurm.account=rl-acct",
    "launch.slurm.partition=h100",
    "launch.slurm.nodes=2",
    "launch.slurm.container_image=nvcr.io/nvidia/nemo:25.09",
    "launch.slurm.time=02:30:00",
    "launch.slurm.container_mounts=['/lustre/data:/data']",
    "launch.slurm.env={NCCL_DEBUG: INFO}",
    "launch.slurm.retries=3",
    "launch.slurm.rdzv_port=29777",
]


def _dryrun(tmp_path, *overrides):
    done = _launch(
        "slurm",
        "--config",
        PAPER,
        "--dryrun",
        f"launch.home={tmp_path / 'home'}",
        f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}",
        *SLURM,
        *overrides,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_slurm_dryrun_script_matches_config(tmp_path):
    script = _dryrun(tmp_path)
    for line in (
        "#SBATCH --account=rl-acct",
        "#SBATCH --partition=h100",
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --time=02:30:00",
        "#SBATCH --exclusive",
        "export TORCHX_MAX_RETRIES=3",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export NCCL_DEBUG=INFO",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
    ):
        assert line in script.splitlines(), line
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container-image nvcr.io/nvidia/nemo:25.09" in srun
    assert re.search(r"--container-mounts /lustre/data:/data,\S+:/nemo_run", srun)
    torchrun = srun[srun.index("torchrun") :]
    assert "--rdzv-backend c10d --rdzv-endpoint $head_node_ip:29777" in torchrun
    assert "--nnodes 2 --nproc-per-node 8 --node-rank $SLURM_NODEID" in torchrun
    assert torchrun.endswith(f"-m megatron_kl.cli train --config {PAPER}")  # launch.* overrides stay here
    assert "scontrol requeue" in script  # retries requeue; the trainer resumes from its checkpoint


# the paper configs colocate SGLang with the trainer; on their own nodes the servers keep their memory and
# take weights over NCCL
DISAGGREGATED = (
    "rollout.sglang.colocated=false",
    "rollout.sglang.enable_memory_saver=false",
    "rollout.sglang.weight_sync=from_distributed",
)


def test_slurm_dryrun_disaggregated_sglang(tmp_path):
    script = _dryrun(
        tmp_path,
        *DISAGGREGATED,
        "launch.rollout_servers.mode=disaggregated",
        "launch.rollout_servers.nodes=3",
        "launch.rollout_servers.tp_size=2",
        "launch.rollout_servers.model_path=/data/qwen2.5-7b",
    )
    lines = script.splitlines()
    assert "#SBATCH hetjob" in lines
    assert lines.count("#SBATCH --nodes=3") == 1 and lines.count("#SBATCH --nodes=2") == 1
    assert next(line for line in lines if line.startswith("srun --het-group=0")).endswith("train-0.sh & pids[0]=$!")
    server = lines[lines.index(next(x for x in lines if x.startswith("# ---- train-0.sh"))) + 2]
    assert server.startswith(
        "python -m sglang.launch_server --model-path /data/qwen2.5-7b --host 0.0.0.0 "
        "--port 30000 --tp-size 2 --dp-size 4"
    )
    assert next(line for line in lines if line.startswith("srun --het-group=1"))
    urls = next(line for line in lines if line.startswith("export MEGATRON_KL_SGLANG_URLS="))
    assert "$SLURM_JOB_NODELIST_HET_GROUP_0" in urls and ":30000" in urls
    trainer = lines[lines.index(next(x for x in lines if x.startswith("# ---- train-1.sh"))) + 2]
    assert trainer.startswith(
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MEGATRON_KL_TRAIN_HEAD:29777"
    )
    assert trainer.endswith(
        'weight_sync=from_distributed "rollout.sglang.urls=[$MEGATRON_KL_SGLANG_URLS]" '
        "rollout.sglang.api_key_env=MEGATRON_KL_SGLANG_API_KEY"
    )
    # a per-job API key, generated in the script and given to the servers (they bind 0.0.0.0)
    assert any(line.startswith("export MEGATRON_KL_SGLANG_API_KEY=$(head -c 32 /dev/urandom") for line in lines)
    assert server.endswith('--api-key "$MEGATRON_KL_SGLANG_API_KEY"'), server


REWARD_SERVICE = (
    "reward.functions=[{name: service}]",
    "launch.reward_service.mode=heterogeneous",
    "launch.reward_service.nodes=2",
    "launch.reward_service.port=8123",
    "launch.reward_service.command=[python, -m, lab.verifier, --port, '{port}', --note, 'a b;$HOME']",
)


def _inline(lines, name):
    return lines[lines.index(next(x for x in lines if x.startswith(f"# ---- {name}"))) + 2]


def test_slurm_dryrun_verifier_service_as_its_own_group(tmp_path):
    lines = _dryrun(tmp_path, *REWARD_SERVICE).splitlines()
    assert "#SBATCH hetjob" in lines and lines.count("#SBATCH --nodes=2") == 2
    assert _inline(lines, "train-0.sh") == "python -m lab.verifier --port 8123 --note 'a b;$HOME'"
    urls = next(line for line in lines if line.startswith("export MEGATRON_KL_REWARD_URLS="))
    assert "$SLURM_JOB_NODELIST_HET_GROUP_0" in urls and ":8123" in urls
    head = next(line for line in lines if line.startswith("export MEGATRON_KL_TRAIN_HEAD="))
    assert "$SLURM_JOB_NODELIST_HET_GROUP_1" in head
    assert not any("MEGATRON_KL_SGLANG_URLS" in line for line in lines)  # SGLang stays with the trainer
    trainer = _inline(lines, "train-1.sh")
    assert trainer.startswith("torchrun --nnodes 2") and trainer.endswith(
        '"reward.service.urls=[$MEGATRON_KL_REWARD_URLS]"'
    )
    assert any("HET_GROUP_0" in line and line.startswith("export no_proxy=") for line in lines)


def test_slurm_dryrun_rollout_servers_and_verifier_service_in_one_job(tmp_path):
    lines = _dryrun(
        tmp_path,
        *DISAGGREGATED,
        *REWARD_SERVICE,
        "launch.rollout_servers.mode=disaggregated",
        "launch.rollout_servers.nodes=3",
        "launch.rollout_servers.model_path=/data/qwen2.5-7b",
    ).splitlines()
    assert [line for line in lines if line.startswith("#SBATCH --nodes=")] == [
        "#SBATCH --nodes=3",
        "#SBATCH --nodes=2",
        "#SBATCH --nodes=2",
    ]
    assert _inline(lines, "train-0.sh").startswith("python -m sglang.launch_server")
    assert _inline(lines, "train-1.sh").startswith("python -m lab.verifier")
    assert "HET_GROUP_0" in next(x for x in lines if x.startswith("export MEGATRON_KL_SGLANG_URLS="))
    assert "HET_GROUP_1" in next(x for x in lines if x.startswith("export MEGATRON_KL_REWARD_URLS="))
    assert "HET_GROUP_2" in next(x for x in lines if x.startswith("export MEGATRON_KL_TRAIN_HEAD="))
    trainer = _inline(lines, "train-2.sh")
    assert (
        '"rollout.sglang.urls=[$MEGATRON_KL_SGLANG_URLS]" rollout.sglang.api_key_env=MEGATRON_KL_SGLANG_API_KEY '
        '"reward.service.urls=[$MEGATRON_KL_REWARD_URLS]"'
    ) in trainer
    assert sum(line.startswith('export no_proxy="${no_proxy:+') for line in lines) == 2


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["launch.reward_service.mode=heterogeneous", "launch.reward_service.command=[x]"], "no reward calls"),
        (
            ["reward.functions=[{name: service}]", "launch.reward_service.mode=heterogeneous"],
            "launch.reward_service.command is empty",
        ),
    ],
)
def test_slurm_refuses_a_verifier_group_that_cannot_work(tmp_path, overrides, says):
    done = _launch(
        "slurm",
        "--config",
        PAPER,
        "--dryrun",
        f"launch.home={tmp_path / 'home'}",
        f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}",
        *SLURM,
        *overrides,
    )
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["launch.slurm.account=null"], "launch.slurm.account"),
        (["launch.slurm.nodes=1", "launch.slurm.gpus_per_node=3"], "parallel.tensor_parallel"),
        (["checkpoint.resume=false"], "checkpoint.resume"),
        (["launch.rollout_servers.mode=disaggregated", "rollout.engine=local"], "rollout.engine=sglang"),
        (["launch.rollout_servers.mode=disaggregated"], "rollout.sglang.colocated=false"),
        (["launch.rollout_servers.mode=disaggregated", "rollout.sglang.colocated=false"], "weight_sync=from_tensor"),
        (["launch.slurm.tunnel.kind=ssh"], "launch.slurm.tunnel.host"),
    ],
)
def test_slurm_config_errors_name_the_field(tmp_path, overrides, field):
    done = _launch("slurm", "--config", PAPER, "--dryrun", f"launch.home={tmp_path}", *SLURM, *overrides)
    assert done.returncode == 2
    assert field in done.stderr


def test_slurm_dryrun_of_the_moe_paper_config(tmp_path):
    """configs/paper/qwen3-30b-a3b.yaml (4 nodes, TP=1 x PP=2 x EP=8) writes its 4-node script; a TP=2 variant
    without sequence parallelism is refused before anything is written."""
    config = str(ROOT / "configs" / "paper" / "qwen3-30b-a3b.yaml")
    common = [
        f"launch.home={tmp_path / 'home'}",
        f"launch.slurm.tunnel.job_dir={tmp_path / 'jobs'}",
        "launch.slurm.account=rl-acct",
        "launch.slurm.container_image=nvcr.io/nvidia/nemo:25.09",
    ]
    done = _launch("slurm", "--config", config, "--dryrun", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --gpus-per-node=8" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--nnodes 4 --nproc-per-node 8 --node-rank $SLURM_NODEID" in srun
    assert srun.endswith(f"-m megatron_kl.cli train --config {config}")
    refused = _launch("slurm", "--config", config, "--dryrun", *common, "parallel.tensor_parallel=2")
    assert refused.returncode != 0 and "parallel.sequence_parallel=true" in refused.stderr
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").rglob("*.sh"))
