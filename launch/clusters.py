"""Your clusters, one function each: copy one, rename it, edit the values, and it is a ``--cluster`` choice of
``launch/train.py``, ``launch/study.py`` and ``launch/validate.py``.

A function returns a :class:`megatron_kl.launch.cluster.Cluster`:

- ``executor``: ``"local"`` (NeMo-Run's LocalExecutor + torchrun on this machine) or ``"slurm"`` (its
  SlurmExecutor: sbatch with a pyxis/enroot container, submitted on the login node or through SSH);
- ``launch``: the ``launch:`` section of the config for this machine (every key is documented in
  ``megatron_kl/config/launch.py``; the YAML's own launch section is the default, command-line overrides win);
- ``customize``: optional, edits the NeMo-Run executor itself for what the settings do not cover
  (``executor.additional_parameters``, ``executor.srun_args``, ``executor.mem`` ...).
"""

from __future__ import annotations

import getpass

from megatron_kl.launch.cluster import Cluster


def local() -> Cluster:
    """This machine: torchrun with tensor_parallel x pipeline_parallel ranks (``launch.nproc_per_node`` to change)."""
    return Cluster("local", {"home": "runs/nemo_run"}, description="torchrun on this machine")


def _h100_slurm(tunnel: dict) -> dict:
    """What both ways of reaching the H100 cluster share. Edit: account, partition, image, mounts, paths."""
    return {
        "home": "runs/nemo_run",  # experiment records on this machine (``megatron-kl launch status <id>``)
        "slurm": {
            "account": "my-account",
            "partition": "h100",
            "gpus_per_node": 8,
            "time": "04:00:00",
            "exclusive": True,
            # pyxis/enroot image with megatron-kl's GPU stack (megatron-core, Transformer Engine, SGLang)
            "container_image": "nvcr.io/nvidia/nemo:25.09",
            "container_mounts": ["/lustre:/lustre"],  # datasets, HF checkpoints, run directories
            "retries": 2,  # requeues; the trainer resumes from its checkpoint (signal_lead_s before the limit)
            "signal_lead_s": 300,
            "nccl_defaults": True,  # megatron_kl/config/launch.py: NCCL_H100_ENV
            "env": {
                "HF_HOME": "/lustre/cache/huggingface",
                # the fabric's HCAs; `ibv_devinfo` on a compute node lists them
                "NCCL_IB_HCA": "mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
            },
            "tunnel": tunnel,
        },
    }


def h100() -> Cluster:
    """The H100 cluster from a laptop or workstation: sbatch over SSH to the login node."""
    user = getpass.getuser()
    return Cluster(
        "slurm",
        _h100_slurm(
            {
                "kind": "ssh",
                "host": "login.h100.example.org",
                "user": user,
                "job_dir": f"/lustre/users/{user}/nemo_run_jobs",  # shared filesystem: code archive, sbatch, logs
            }
        ),
        description="Slurm H100 nodes, submitted over SSH",
    )


def h100_login() -> Cluster:
    """The same cluster from its login node: sbatch runs here (local tunnel)."""
    return Cluster(
        "slurm",
        _h100_slurm({"kind": "local", "job_dir": "runs/nemo_run_jobs"}),
        description="Slurm H100 nodes, submitted on the login node",
    )


def ci() -> Cluster:
    """The two-node Slurm cluster of ``scripts/slurm_cluster.sh`` (CI, or a workstation as root): CPU nodes, one
    trainer rank per node, the nodes' own Python (no container), sbatch on this machine. Start it first and export
    what it prints (``SLURM_CONF``). Its home holds no ``/nemo_run`` component: without a container NeMo-Run
    rewrites that name (its in-container run directory) in every path of the job."""
    home = "runs/launch_ci"
    return Cluster(
        "slurm",
        {
            "home": home,
            "slurm": {
                "account": "ci",
                "partition": "ci",
                "nodes": 2,
                "gpus_per_node": 0,
                "ranks_per_node": 1,
                "runtime": "host",
                "time": "00:15:00",
                "exclusive": False,
                "nccl_defaults": False,
                "retries": 1,
                "signal_lead_s": 30,
                "rdzv_port": 29531,
                "env": {"OMP_NUM_THREADS": "1"},
                "tunnel": {"kind": "local", "job_dir": f"{home}/experiments"},  # NeMo-Run's LocalTunnel wants home's
            },
            # disaggregated rollouts: the server's group on one node (CPU: the SGLang test server stands in where
            # SGLang is not installed, rollout.sglang.server_module), checked every few seconds
            "rollout_servers": {"gpus_per_node": 0, "trainer_start_delay_s": 2, "monitor_interval_s": 5},
        },
        description="two CPU nodes of scripts/slurm_cluster.sh, submitted on this machine",
    )


CLUSTERS = {"local": local, "h100": h100, "h100_login": h100_login, "ci": ci}
