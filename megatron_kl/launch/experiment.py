"""One NeMo-Run Experiment per ``megatron-kl launch``: a training job, or a study's grid (one task per run).

NeMo-Run reports task failures quietly (the experiment "finishes" either way), so after a run every task's
final state is read back and a failed task makes the launch fail with the tail of that task's log.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_kl.config import ConfigError, read_yaml_file
from megatron_kl.constraints import paths_unchecked
from megatron_kl.launch.jobs import (
    TaskSpec,
    _nemo_run,
    heterogeneous,
    heterogeneous_tasks,
    local_task,
    single_node_task,
    slurm_task,
)
from megatron_kl.redaction import is_secret_flag, secret_flag_values
from megatron_kl.study.grid import expand, load_study
from megatron_kl.train.config import load_train_config

log = logging.getLogger("megatron_kl.launch")
TERMINAL_OK = "SUCCEEDED"


@dataclass
class LaunchPlan:
    title: str
    tasks: list[TaskSpec]
    home: str
    sequential: bool
    study: object = None  # StudyConfig when the config is a study YAML
    runs: list = field(default_factory=list)  # the study's RunSpecs, same order as tasks


def plan(config_path: str, overrides: list[str]) -> LaunchPlan:
    """A training YAML gives one task; a study YAML (it has ``base:``) one task per (configuration, seed). Every
    constraint is checked except the paths', which the job checks where it starts (a cluster's paths)."""
    with paths_unchecked():
        return _plan(config_path, overrides)


def check_no_secret_in_scripts(cfg) -> None:
    """The job scripts hold every server command and override in clear: a secret flag given a value there
    (``--admin-api-key K``, ``--token K``) is refused, naming the field and not the value."""
    for name, args in (
        ("rollout.sglang.extra_args", cfg.rollout.sglang.extra_args),
        ("launch.rollout_servers.extra_args", cfg.launch.rollout_servers.extra_args),
        ("launch.reward_service.command", cfg.launch.reward_service.command),
    ):
        if secret_flag_values(args):
            flags = sorted({str(a).split("=", 1)[0] for a in args if is_secret_flag(str(a))})
            raise ConfigError(
                f"{name} gives {', '.join(flags)} a value: the job script would hold that secret in "
                "clear; have the server read it from an environment variable exported where the job is "
                "submitted (Slurm passes the environment on; the rollout servers' key: "
                "rollout.sglang.api_key_env)"
            )


def _plan(config_path: str, overrides: list[str]) -> LaunchPlan:
    data = read_yaml_file(config_path) if Path(config_path).is_file() else None
    if data is None:
        raise ConfigError(f"config file {config_path} does not exist or is empty")
    if isinstance(data, dict) and "base" in data:
        study = load_study(config_path, overrides)
        runs = expand(study)
        tasks = [TaskSpec(r.name, study.base, r.overrides, load_train_config(study.base, r.overrides)) for r in runs]
        for task in tasks:
            check_no_secret_in_scripts(task.cfg)
        launch = tasks[0].cfg.launch
        return LaunchPlan(launch.experiment or study.name, tasks, launch.home, launch.sequential, study, runs)
    cfg = load_train_config(config_path, overrides)
    check_no_secret_in_scripts(cfg)
    task = TaskSpec("train", config_path, list(overrides), cfg)
    return LaunchPlan(cfg.launch.experiment or cfg.run_name, [task], cfg.launch.home, cfg.launch.sequential)


def _set_home(home: str) -> None:
    from nemo_run.config import set_nemorun_home

    set_nemorun_home(str(Path(home).absolute()))


def build(exp, executor_kind: str, launch_plan: LaunchPlan, customize=None, launcher_pid: Optional[int] = None) -> None:
    """Add every task of the plan to ``exp``; ``customize(executor)`` edits each NeMo-Run executor first;
    ``launcher_pid``: local tasks stop when that process ends (a real launch: its own pid)."""
    for spec in launch_plan.tasks:
        if spec.command is not None:
            if executor_kind != "slurm":
                raise ConfigError(
                    f"task {spec.name} runs `megatron-kl {' '.join(spec.command)}`: run that directly on this machine"
                )
            executor, script = single_node_task(spec)
        elif executor_kind == "local":
            executor, script = local_task(spec, launcher_pid)
        elif heterogeneous(spec.cfg):
            executor, script = heterogeneous_tasks(spec)
        else:
            executor, script = slurm_task(spec)
        if customize is not None:
            for one in executor if isinstance(executor, list) else [executor]:
                customize(one)
        exp.add(script, executor=executor, name=spec.name)


def dryrun(executor_kind: str, launch_plan: LaunchPlan, customize=None) -> dict[str, str]:
    """The scripts NeMo-Run would submit, by task name (sbatch text for Slurm); nothing is launched."""
    run = _nemo_run()
    _set_home(launch_plan.home)
    with run.Experiment(launch_plan.title, log_level="WARN") as exp:
        build(exp, executor_kind, launch_plan, customize)
        exp.dryrun(log=False, delete_exp_dir=False)
        exp_dir = Path(exp._exp_dir)
    scripts = {}
    for spec in launch_plan.tasks:
        sbatch = exp_dir / f"{spec.name}_sbatch.sh"
        text = sbatch.read_text() if sbatch.is_file() else _local_command(exp_dir, spec.name)
        for inline in sorted((exp_dir / spec.name / "scripts").glob("*.sh")):  # inline task scripts
            text += f"\n# ---- {inline.name} (run by srun above)\n{inline.read_text()}"
        scripts[spec.name] = text
    return scripts


def _local_command(exp_dir: Path, name: str) -> str:
    config = exp_dir / name / "configs" / f"{name}_executor.yaml"
    return config.read_text() if config.is_file() else ""


_CAUSE = re.compile(r"megatron-kl [a-z]+(?: --[a-z]+)?: ")  # the CLI's one-line messages (a failure's cause)


def task_log(job_dir: str, lines: int = 40) -> str:
    """Tail of a task's log: torchelastic's per-rank stderr/stdout (local) or the srun log (Slurm)."""
    root = Path(job_dir)
    candidates = dict.fromkeys(
        [*sorted(root.rglob("stderr.log")), *sorted(root.rglob("log-*.out")), *sorted(root.rglob("*.log"))]
    )
    texts = []
    for path in candidates:
        text = path.read_text(errors="replace").strip()
        if text:
            # the trainer's own one-line error first (torchrun's failure summary fills the tail after it)
            causes = dict.fromkeys(line for line in text.splitlines() if _CAUSE.search(line))
            texts.append(
                f"--- {path}\n"
                + "".join(f"{line}\n" for line in list(causes)[:3])
                + "\n".join(text.splitlines()[-lines:])
            )
    return "\n".join(texts[:4]) if texts else f"(no log files under {job_dir})"


def _local_state(handle: str) -> Optional[str]:
    """Final state of a local task from NeMo-Run's persistent local-job record (status() may say UNKNOWN)."""
    from nemo_run.config import get_nemorun_home

    record = Path(get_nemorun_home()) / ".local_jobs.json"
    app_id = handle.rstrip("/").rsplit("/", 1)[-1]
    if record.is_file():
        entry = json.loads(record.read_text()).get(app_id)
        if entry:
            return str(entry[0])
    return None


def task_states(exp) -> dict[str, dict]:
    """name -> {state, job_dir, job_id} for every task of an experiment."""
    out = {}
    for name, info in (exp.status(return_dict=True) or {}).items():
        state = str(info["status"]).split(" ")[0]
        if state in ("UNKNOWN", "RUNNING", "PENDING") and info.get("handle", "").startswith("local"):
            state = _local_state(info["handle"]) or state
        out[name] = {"state": state, "job_dir": info.get("local_dir", ""), "job_id": info.get("job_id", "")}
    return out


def launch(
    executor_kind: str, launch_plan: LaunchPlan, detach: bool = False, customize=None
) -> tuple[str, dict[str, dict]]:
    """Run the experiment; returns (experiment id, task states). Local runs wait; Slurm may detach."""
    run = _nemo_run()
    _set_home(launch_plan.home)
    with run.Experiment(launch_plan.title, log_level="WARN") as exp:
        build(exp, executor_kind, launch_plan, customize, launcher_pid=os.getpid())
        exp.run(sequential=launch_plan.sequential, detach=detach and executor_kind == "slurm")
        exp_id = exp._id
    if detach and executor_kind == "slurm":
        return exp_id, {}
    return exp_id, task_states(run.Experiment.from_id(exp_id))


def reconstruct(exp_id: str, home: str):
    run = _nemo_run()
    _set_home(home)
    try:
        return run.Experiment.from_id(exp_id)
    except (AssertionError, FileNotFoundError, ValueError) as err:
        raise ConfigError(
            f"no NeMo-Run experiment {exp_id!r} under {home} ({err}); "
            "pass --home if it was launched with another launch.home"
        ) from None
