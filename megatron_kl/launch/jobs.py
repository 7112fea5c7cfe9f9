"""NeMo-Run executors and tasks for a training job (and for each run of a study).

- local: ``LocalExecutor`` + NeMo-Run's torchrun launcher, ``nproc_per_node`` ranks of ``megatron-kl train``.
- slurm: ``SlurmExecutor`` (pyxis container, mounts, NCCL/H100 environment, git-archive packager, local or
  SSH tunnel) + torchrun across nodes with the c10d rendezvous on the head node; failures requeue the job
  up to ``retries`` times and the trainer resumes from its latest checkpoint (``checkpoint.resume``).
- heterogeneous jobs: disaggregated SGLang (``launch.rollout_servers.mode=disaggregated``: one
  ``sglang.launch_server``, or ``rollout.sglang.server_module``, per rollout node) and / or a verifier service
  (``launch.reward_service.mode=heterogeneous``: its command per node) as groups of one Slurm job, the trainer the
  last group; the groups' hosts are resolved in the sbatch script and passed to the trainer as
  ``rollout.sglang.urls`` / ``reward.service.urls``.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_kl.config import ConfigError, validate_parallel, validate_training_layout
from megatron_kl.rollout.registry import ENGINES
from megatron_kl.train.config import TrainConfig

URLS_VAR = "MEGATRON_KL_SGLANG_URLS"
REWARD_URLS_VAR = "MEGATRON_KL_REWARD_URLS"
API_KEY_VAR = "MEGATRON_KL_SGLANG_API_KEY"  # rollout.sglang.api_key_env's default
TRAIN_HEAD_VAR = "MEGATRON_KL_TRAIN_HEAD"


@dataclass
class TaskSpec:
    """One task of an experiment: its name, the config file and the overrides of ``megatron-kl train``."""

    name: str
    config_path: str
    overrides: list[str]
    cfg: TrainConfig
    command: Optional[list[str]] = None  # ``megatron-kl`` arguments of a task that is not training (validate)

    def train_args(self, extra: list[str] = ()) -> list[str]:
        """``megatron-kl train`` arguments; ``launch.*`` overrides stay with the launcher."""
        overrides = [o for o in self.overrides if not o.startswith("launch.")]
        return ["train", "--config", self.config_path, *overrides, *extra]


def _nemo_run():
    try:
        import nemo_run
    except ImportError as err:  # the `launch` extra
        raise ConfigError(
            "megatron-kl launch needs NeMo-Run: pip install -e '.[launch]' (nemo-run==0.11.1, leptonai<0.47)"
        ) from err
    return nemo_run


def local_task(spec: TaskSpec, launcher_pid: Optional[int] = None):
    """(executor, script) for torchrun on this machine, ``nproc_per_node`` ranks; ``launcher_pid``: the process whose
    end stops the trainers (a real launch passes its own; a dry run shows none)."""
    run = _nemo_run()
    cfg = spec.cfg
    nproc = cfg.launch.nproc_per_node or (
        cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel * cfg.parallel.context_parallel
    )
    validate_parallel(cfg.model, cfg.parallel, nproc)
    # torchrun and python of this environment, whether or not it is activated
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), **cfg.launch.env}
    if launcher_pid is not None:
        # the trainers stop (SIGTERM: they save their finished steps) when the launcher ends, killed or stopped:
        # NeMo-Run's local executor does not pass that on to torchrun
        env["MEGATRON_KL_PARENT_PID"] = str(launcher_pid)
    executor = run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun", env_vars=env)
    script = run.Script(path="megatron_kl.cli", m=True, entrypoint="python", args=spec.train_args())
    return executor, script


def _check_slurm(cfg: TrainConfig) -> None:
    slurm = cfg.launch.slurm
    if not slurm.account:
        raise ConfigError("launch.slurm.account is required for `megatron-kl launch slurm`")
    if slurm.runtime == "container" and not slurm.container_image:
        raise ConfigError(
            "launch.slurm.container_image is required (NeMo-Run's Slurm executor runs tasks "
            "in a pyxis/enroot container); or set launch.slurm.runtime=host to run in the nodes' own "
            "environment"
        )
    if slurm.runtime == "host" and "/nemo_run" in str(Path(slurm.tunnel.job_dir).absolute()):
        raise ConfigError(
            f"launch.slurm.tunnel.job_dir={slurm.tunnel.job_dir!r} (or launch.home) has a 'nemo_run' "
            "directory: with launch.slurm.runtime=host NeMo-Run rewrites '/nemo_run' (its in-container "
            "run directory) in every path of the job; choose another directory name"
        )
    if slurm.runtime == "host" and slurm.container_image:
        raise ConfigError(
            f"launch.slurm.runtime=host runs without a container: drop launch.slurm.container_image="
            f"{slurm.container_image!r}, or set launch.slurm.runtime=container"
        )
    if slurm.retries and not cfg.checkpoint.resume:
        raise ConfigError(
            f"launch.slurm.retries={slurm.retries} restarts the job; set checkpoint.resume=true "
            "so a restart continues from the latest checkpoint instead of step 0"
        )
    validate_parallel(cfg.model, cfg.parallel, slurm.nodes * slurm.tasks_per_node)
    validate_training_layout(cfg.model, cfg.parallel, cfg.train.micro_batch_tokens)
    if not SHELL_WORD.fullmatch(str(slurm.tunnel.job_dir)):
        raise ConfigError(
            f"launch.slurm.tunnel.job_dir={slurm.tunnel.job_dir!r}: NeMo-Run writes it unquoted into "
            "the srun lines; use letters, digits and / . _ - : @ + = , ~ only"
        )
    shell_env(cfg)  # names checked before anything is written
    servers = cfg.launch.rollout_servers
    if servers.mode == "disaggregated":
        if ENGINES.get(cfg.rollout.engine, "rollout.engine").server_flags is None:
            raise ConfigError(
                f"launch.rollout_servers.mode=disaggregated starts rollout servers, which "
                f"rollout.engine={cfg.rollout.engine} has none of; set rollout.engine="
                + " or ".join(ENGINES.where(lambda e: e.server_flags is not None))
            )
        if cfg.rollout.sglang.colocated:
            raise ConfigError(
                "launch.rollout_servers.mode=disaggregated puts the SGLang servers on their own nodes: "
                "set rollout.sglang.colocated=false (memory release is for servers sharing the "
                "trainer's GPUs)"
            )
        if cfg.rollout.sglang.weight_sync == "from_tensor":
            raise ConfigError(
                "rollout.sglang.weight_sync=from_tensor hands tensors to servers on the same node; "
                "disaggregated servers need from_distributed (NCCL) or from_disk (shared filesystem)"
            )
        if not MODULE.fullmatch(cfg.rollout.sglang.server_module):
            raise ConfigError(
                f"rollout.sglang.server_module={cfg.rollout.sglang.server_module!r} is run as "
                "`python -m MODULE` in the job script: a dotted Python module name "
                "(sglang.launch_server)"
            )
        if not (servers.model_path or cfg.init.hf_checkpoint):
            raise ConfigError(
                "disaggregated SGLang servers need launch.rollout_servers.model_path (or init.hf_checkpoint)"
            )
    service = cfg.launch.reward_service
    if service.mode == "heterogeneous":
        if not any(f.name == "service" for f in cfg.reward.functions):
            raise ConfigError(
                "launch.reward_service.mode=heterogeneous starts a verifier service that no reward calls: "
                "add {name: service} to reward.functions, or set launch.reward_service.mode=none"
            )
        if not service.command:
            raise ConfigError(
                "launch.reward_service.command is empty: give the service's command line, one argument "
                "per item, e.g. [python, -m, my_lab.verifier, --port, '{port}']"
            )


def heterogeneous(cfg: TrainConfig) -> bool:
    """Whether the job has groups besides the trainer's (rollout servers, a verifier service)."""
    return cfg.launch.rollout_servers.mode == "disaggregated" or cfg.launch.reward_service.mode == "heterogeneous"


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
SHELL_WORD = re.compile(r"[A-Za-z0-9_./@%+=:,~-]+")  # needs no quoting in a shell command line


def shell_env(cfg: TrainConfig) -> dict:
    """The job's environment for the sbatch script: NeMo-Run writes ``export KEY=VALUE`` as given, so each
    value is shell-quoted here (a literal string: ``$``, ``;``, backticks are not interpreted) and each
    name must be a shell variable name."""
    env = {}
    for field, values in (("launch.slurm.env", cfg.launch.slurm.environment()), ("launch.env", cfg.launch.env)):
        for key, value in values.items():
            if not ENV_NAME.fullmatch(str(key)):
                raise ConfigError(
                    f"{field}: {key!r} is not an environment variable name (letters, digits and "
                    "underscores, not starting with a digit)"
                )
            env[str(key)] = shlex.quote(str(value))
    return env


def _slurm_executor(
    cfg: TrainConfig,
    nodes: int,
    tasks_per_node: int,
    launcher,
    heterogeneous: bool,
    setup_lines: str | None = None,
    stop_signal: bool = True,
):
    """``stop_signal``: this (component of the) job gets SIGUSR1 ahead of its time limit (the trainer's; the
    rollout servers of a heterogeneous job are not signalled: they serve until the trainer has checkpointed)."""
    run = _nemo_run()
    slurm = cfg.launch.slurm
    tunnel_cfg = slurm.tunnel
    if tunnel_cfg.kind == "ssh":
        tunnel = run.SSHTunnel(
            host=tunnel_cfg.host, user=tunnel_cfg.user, job_dir=tunnel_cfg.job_dir, identity=tunnel_cfg.identity
        )
    else:
        tunnel = run.LocalTunnel(job_dir=str(Path(tunnel_cfg.job_dir).absolute()))
    packager = run.GitArchivePackager() if slurm.packager == "git" else run.Packager()
    if slurm.runtime == "host":  # sbatch hands its environment to the job: this Python and its torchrun first
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return run.SlurmExecutor(
        account=slurm.account,
        partition=slurm.partition,
        nodes=nodes,
        ntasks_per_node=tasks_per_node,
        gpus_per_node=slurm.gpus_per_node or None,
        time=slurm.time,
        container_image=slurm.container_image,
        container_mounts=list(slurm.container_mounts),
        exclusive=slurm.exclusive or None,
        qos=slurm.qos,
        constraint=slurm.constraint,
        tunnel=tunnel,
        packager=packager,
        launcher=launcher,
        env_vars=shell_env(cfg),
        retries=slurm.retries,
        heterogeneous=heterogeneous,
        setup_lines=setup_lines,
        job_name_prefix="megatron-kl.",
        signal=slurm.sbatch_signal() if stop_signal else None,
        **({"container_workdir": slurm.container_workdir} if slurm.container_workdir else {}),
    )


def slurm_task(spec: TaskSpec):
    """(executor, script) for one multi-node training job: torchrun with the c10d rendezvous."""
    run = _nemo_run()
    cfg = spec.cfg
    _check_slurm(cfg)
    slurm = cfg.launch.slurm
    launcher = run.Torchrun(rdzv_port=slurm.rdzv_port)
    executor = _slurm_executor(cfg, slurm.nodes, slurm.tasks_per_node, launcher, heterogeneous=False)
    script = run.Script(path="megatron_kl.cli", m=True, entrypoint="python", args=spec.train_args())
    return executor, script


def single_node_task(spec: TaskSpec):
    """(executor, script) for one process on one whole node running ``megatron-kl <spec.command>`` (it starts
    its own ranks): ``megatron-kl validate`` on a fresh node."""
    run = _nemo_run()
    _check_slurm(spec.cfg)
    executor = _slurm_executor(spec.cfg, 1, 1, None, heterogeneous=False, stop_signal=False)
    script = run.Script(path="megatron_kl.cli", m=True, entrypoint="python", args=list(spec.command))
    return executor, script


def rollout_server_args(cfg: TrainConfig) -> list[str]:
    """The disaggregated servers' flags: the rollout engine's own builder (``EngineSpec.server_flags``, for SGLang the
    managed servers' ``rollout/sglang.server_flags``) with the launch section's layout."""
    return ENGINES.get(cfg.rollout.engine, "rollout.engine").server_flags(cfg)


def _hosts(group: int, port: int) -> str:
    """The shell pipeline listing a group's nodes as quoted URLs ``"http://<node>:<port>"``, comma-separated."""
    return (
        f'$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{group}" '
        f"| sed 's|.*|\"http://&:{port}\"|' | paste -sd, -)"
    )


def heterogeneous_tasks(spec: TaskSpec):
    """(executors, scripts) of one heterogeneous job: the rollout servers' group (disaggregated SGLang) and the verifier
    service's group where configured, then the trainer's group."""
    run = _nemo_run()
    cfg = spec.cfg
    _check_slurm(cfg)
    slurm, servers, service = cfg.launch.slurm, cfg.launch.rollout_servers, cfg.launch.reward_service
    rollout = servers.mode == "disaggregated"
    groups = (["rollout"] if rollout else []) + (["reward"] if service.mode == "heterogeneous" else [])
    trainer_group = len(groups)
    # Resolved in the sbatch script (outside the containers), exported into every group's srun steps.
    setup = []
    if rollout:
        setup += [
            # a fresh key per job (never in a file, nor in the job's log: NeMo-Run's script traces every command with
            # set -x, so tracing is off while the key is made); the servers bind 0.0.0.0 and one route unpickles its
            # input
            "{ xtrace=$(set +o | grep xtrace); set +x; } 2>/dev/null",
            f"export {API_KEY_VAR}=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')",
            'eval "$xtrace"',
            f"export {URLS_VAR}={_hosts(groups.index('rollout'), servers.port)}",
        ]
    if "reward" in groups:
        setup.append(f"export {REWARD_URLS_VAR}={_hosts(groups.index('reward'), service.port)}")
    setup += [
        f'export {TRAIN_HEAD_VAR}=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{trainer_group}" '
        "| head -n1)",
        # the trainer reaches the servers directly, never through a site's HTTP proxy: their nodes join no_proxy
        'export no_proxy="${no_proxy:-${NO_PROXY:-}}"',
    ]
    for group in range(trainer_group):
        setup.append(
            'export no_proxy="${no_proxy:+$no_proxy,}$(scontrol show hostnames '
            f'"$SLURM_JOB_NODELIST_HET_GROUP_{group}" | paste -sd, -)"'
        )
    setup.append('export NO_PROXY="$no_proxy"')
    executors, scripts = [], []
    for index, group in enumerate(groups):
        nodes, gpus = (
            (servers.nodes, servers.gpus_per_node) if group == "rollout" else (service.nodes, service.gpus_per_node)
        )
        executor = _slurm_executor(
            cfg,
            nodes,
            1,
            None,
            heterogeneous=True,
            setup_lines="\n".join(setup) if index == 0 else None,
            stop_signal=False,
        )
        executor.gpus_per_node = gpus or None  # 0: CPU nodes (the CI cluster's test server, a rule-based verifier)
        executors.append(executor)
        if group == "rollout":
            # an inline script (srun runs `bash server.sh`): the key is expanded there, not in the traced job script
            scripts.append(
                run.Script(
                    inline=" ".join(
                        [
                            "python",
                            "-m",
                            cfg.rollout.sglang.server_module,
                            *(shlex.quote(a) for a in rollout_server_args(cfg)),
                            "--api-key",
                            f'"${API_KEY_VAR}"',
                        ]
                    )
                )
            )
        else:
            scripts.append(
                run.Script(
                    inline=" ".join(shlex.quote(a.replace("{port}", str(service.port))) for a in service.command)
                )
            )
    # one srun task per trainer node, each running torchrun for that node's GPUs
    executors.append(_slurm_executor(cfg, slurm.nodes, 1, None, heterogeneous=True))
    for executor in executors:
        executor.wait_time_for_group_job = servers.trainer_start_delay_s
        executor.monitor_group_job_wait_time = servers.monitor_interval_s
    torchrun = [
        "torchrun",
        "--nnodes",
        str(slurm.nodes),
        "--nproc-per-node",
        str(slurm.tasks_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"${TRAIN_HEAD_VAR}:{slurm.rdzv_port}",
        "--rdzv-id",
        "$SLURM_JOB_ID",
        "-m",
        "megatron_kl.cli",
    ]
    # every user value shell-quoted; the intended expansions are the groups' URLs, from fixed templates
    urls = []
    if rollout:
        urls.append(f'"rollout.sglang.urls=[${URLS_VAR}]" rollout.sglang.api_key_env={API_KEY_VAR}')
    if "reward" in groups:
        urls.append(f'"reward.service.urls=[${REWARD_URLS_VAR}]"')
    line = " ".join(torchrun) + " " + " ".join(shlex.quote(a) for a in spec.train_args()) + " " + " ".join(urls)
    scripts.append(run.Script(inline=line))
    return executors, scripts
