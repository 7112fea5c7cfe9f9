"""The ``launch`` section of a training config: how NeMo-Run starts the job (local torchrun or Slurm).

The trainer ignores this section; ``megatron-kl launch`` reads it. Every field is a YAML key
(``launch.slurm.nodes=4`` on the command line) and is checked here, before anything is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_kl.config import ConfigError
from megatron_kl.constraints import check_declared, checked

# NCCL / H100 defaults put into every Slurm job's environment (``launch.slurm.nccl_defaults: false`` drops
# them; ``launch.slurm.env`` overrides single ones). Why each:
NCCL_H100_ENV = {
    # Megatron's TP/SP comm-compute overlap needs one CUDA stream per device connection.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # Surface NCCL errors as exceptions in the failing rank instead of a silent hang.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # InfiniBand / RoCE: use the HCA's GPUDirect RDMA when the fabric supports it (H100 SXM nodes do).
    "NCCL_NET_GDR_LEVEL": "PHB",
    # Log NCCL topology once at WARN level; set INFO when debugging a fabric problem.
    "NCCL_DEBUG": "WARN",
    # NVLink SHARP on H100 NVSwitch systems (NVLS) for intra-node all-reduce.
    "NCCL_NVLS_ENABLE": "1",
    # Keep the CPU threads per rank small: 8 ranks per node share the node's cores.
    "OMP_NUM_THREADS": "8",
}

ROLLOUT_MODES = ("colocated", "disaggregated")
TUNNELS = ("local", "ssh")
RUNTIMES = ("container", "host")
PACKAGERS = ("git", "none")


def _check_env(env, where: str) -> dict:
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise ConfigError(f"{where} must be a mapping NAME: value, got {env!r}")
    return {k: str(v) for k, v in env.items()}


@dataclass(frozen=True)
class TunnelConfig:
    """Where sbatch runs: ``local`` (this machine is a Slurm login node) or ``ssh`` to a login node."""

    kind: str = checked("local", choices=TUNNELS)
    host: Optional[str] = checked(None, free=True)
    user: Optional[str] = checked(None, free=True)
    identity: Optional[str] = checked(None, free=True)  # ssh private key file
    job_dir: str = checked(
        "runs/nemo_run_jobs", free=True, nonempty=True
    )  # on the cluster's shared filesystem: code archive, sbatch, logs

    def __post_init__(self):
        check_declared(self, "launch.slurm.tunnel.")
        if self.kind == "ssh" and not (self.host and self.user):
            raise ConfigError("launch.slurm.tunnel.kind=ssh needs launch.slurm.tunnel.host and .user")


@dataclass(frozen=True)
class SlurmConfig:
    account: Optional[str] = checked(None, free=True)
    partition: Optional[str] = checked(None, free=True)
    nodes: int = checked(1, ge=1)  # training nodes
    gpus_per_node: int = checked(8, ge=0)  # 0: CPU nodes (set ranks_per_node)
    ranks_per_node: Optional[int] = checked(None, ge=1)  # trainer ranks per node; null: one per GPU
    # container: tasks run in container_image (pyxis/enroot); host: in the nodes' own environment (the Python that
    # submits, which must exist on every node at the same path: a workstation's or CI's own cluster)
    runtime: str = checked("container", choices=RUNTIMES)
    time: str = checked("04:00:00", free=True, nonempty=True)
    container_image: Optional[str] = checked(None, free=True)  # pyxis/enroot image with megatron-kl's GPU stack
    container_mounts: list[str] = field(default_factory=list)  # "/lustre:/lustre"
    container_workdir: Optional[str] = checked(None, free=True)  # default: the packaged code (/nemo_run/code)
    exclusive: bool = True
    qos: Optional[str] = checked(None, free=True)
    constraint: Optional[str] = checked(None, free=True)
    env: dict = field(default_factory=dict)  # extra variables, override NCCL_H100_ENV
    nccl_defaults: bool = True
    retries: int = checked(2, ge=0)  # requeues after a failure; the trainer resumes from its latest checkpoint
    rdzv_port: int = checked(29500, ge=1, le=65535)  # torchrun c10d rendezvous port on the head node
    # seconds before the time limit at which Slurm sends SIGUSR1 (sbatch --signal); the trainer finishes its
    # step, checkpoints and exits 75 so the job requeues and resumes. Also torchrun's grace period for that.
    # 0: no signal (the job is killed at the limit and resumes from its last interval checkpoint).
    signal_lead_s: int = checked(300, ge=0)
    packager: str = checked(
        "git", choices=PACKAGERS
    )  # git: `git archive` of HEAD goes to the cluster; none: the image has the code
    tunnel: TunnelConfig = field(default_factory=TunnelConfig)

    def __post_init__(self):
        check_declared(self, "launch.slurm.")
        if self.gpus_per_node == 0 and self.ranks_per_node is None:
            raise ConfigError(
                "launch.slurm.gpus_per_node=0 (CPU nodes) needs launch.slurm.ranks_per_node, the trainer ranks per node"
            )
        if not isinstance(self.container_mounts, list):
            raise ConfigError("launch.slurm.container_mounts must be a list of 'src:dst' strings")
        object.__setattr__(self, "env", _check_env(self.env, "launch.slurm.env"))

    @property
    def tasks_per_node(self) -> int:
        """Trainer ranks per node: ``ranks_per_node``, else one per GPU."""
        return self.ranks_per_node or self.gpus_per_node

    def environment(self) -> dict:
        env = dict(NCCL_H100_ENV) if self.nccl_defaults else {}
        if self.signal_lead_s:
            env.update(stop_signal_env(self.signal_lead_s))
        env.update(self.env)
        return env

    def sbatch_signal(self) -> Optional[str]:
        """``#SBATCH --signal``: SIGUSR1 to every job step ``signal_lead_s`` before the time limit."""
        return f"USR1@{self.signal_lead_s}" if self.signal_lead_s else None


def stop_signal_env(grace_s: int) -> dict:
    """torchrun forwards SIGUSR1 (not only SIGTERM/SIGINT/...) to its workers and gives them ``grace_s`` to
    checkpoint before it kills them."""
    return {
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace_s),
    }


@dataclass(frozen=True)
class RolloutServersConfig:
    """SGLang servers for ``rollout.engine=sglang``.

    colocated: the trainer starts SGLang on its own GPUs (``rollout.sglang.launch``), nothing extra here.
    disaggregated: ``nodes`` rollout nodes run one ``sglang.launch_server`` each (data parallel over the
    node's GPUs in groups of ``tp_size``) as their own task group of the same Slurm job; the trainer gets
    their addresses as ``rollout.sglang.urls``.
    """

    mode: str = checked("colocated", choices=ROLLOUT_MODES)
    nodes: int = checked(1, ge=1)
    gpus_per_node: int = checked(8, ge=0)
    tp_size: int = checked(1, ge=1)
    port: int = checked(30000, ge=1, le=65535)
    model_path: Optional[str] = checked(None, free=True)  # default: init.hf_checkpoint
    mem_fraction_static: float = checked(0.85, gt=0, lt=1)
    extra_args: list[str] = field(default_factory=list)
    # the trainer's group starts this long after the servers' in the het job's script (it also waits for /health)
    trainer_start_delay_s: int = checked(30, ge=0)
    # the het job's script checks this often whether a group has ended, and as long later ends the other
    monitor_interval_s: int = checked(60, ge=1)

    def __post_init__(self):
        check_declared(self, "launch.rollout_servers.")
        if self.gpus_per_node % self.tp_size:
            raise ConfigError(
                f"launch.rollout_servers.tp_size={self.tp_size} must divide gpus_per_node={self.gpus_per_node}"
            )


REWARD_SERVICE_MODES = ("none", "heterogeneous")


@dataclass(frozen=True)
class RewardServiceLaunchConfig:
    """A verifier / reward-model service started with the job (``reward.functions`` naming ``service``).

    none: the service runs elsewhere (``reward.service.urls`` names it). heterogeneous: ``nodes`` nodes of the same Slurm
    job run ``command`` each (a group of the heterogeneous job, beside the rollout servers' when they are disaggregated
    too); the trainer gets their addresses as ``reward.service.urls`` (``http://<node>:<port>``).
    """

    mode: str = checked("none", choices=REWARD_SERVICE_MODES)
    nodes: int = checked(1, ge=1)
    gpus_per_node: int = checked(0, ge=0)  # 0: CPU nodes (a rule-based verifier); a reward model wants GPUs
    port: int = checked(8100, ge=1, le=65535)
    # the service's command line, one argument per item (each shell-quoted in the job script); "{port}" in an item is
    # replaced by the port, e.g. [python, -m, my_lab.verifier, --port, "{port}"]
    command: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LaunchConfig:
    experiment: Optional[str] = checked(None, free=True)  # NeMo-Run experiment title; default: the run's name
    home: str = checked("runs/nemo_run", free=True, nonempty=True)  # NEMORUN_HOME: experiment records, local logs
    nproc_per_node: Optional[int] = checked(None, ge=1)  # local: default tensor_parallel x pipeline_parallel ranks
    sequential: bool = True  # study tasks one after another (local); Slurm jobs chain with afterany
    env: dict = field(default_factory=dict)  # environment of every task
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    rollout_servers: RolloutServersConfig = field(default_factory=RolloutServersConfig)
    reward_service: RewardServiceLaunchConfig = field(default_factory=RewardServiceLaunchConfig)

    def __post_init__(self):
        check_declared(self, "launch.")
        object.__setattr__(self, "env", _check_env(self.env, "launch.env"))
