"""One-command node validation (``megatron-kl validate``, ``python launch/validate.py``): run on one node of a
new cluster or in multi-GPU CI, from an installed package or a checkout. The checks are the pytest modules
that ship in ``megatron_kl.validation`` (run with ``pytest --pyargs``), plus, in a checkout, the repository's
other ``gpu``-marked tests.

Checks, each a subprocess with a deadline, reported as pass / fail / skip with its wall time:

- ``gpu_tests``: every ``-m gpu`` test (Transformer Engine layouts - sequence parallel, context parallel CP=2 on two
  GPUs - real SGLang, offload).
- ``layouts``: TP=2, PP=2 and TP=2 x PP=2 forward/backward/update equal to one rank (NCCL and the Transformer
  Engine spec on a GPU node, gloo and the local spec on CPU).
- ``vocab_parallel`` and ``fused_linear``: the float64-referenced kernel tests at TP=8 (NCCL; TP=2 gloo on CPU).
- ``train``: 3 training steps under torchrun with SGLang rollouts and ``from_distributed`` weight sync (real
  SGLang on GPUs with ``--hf-checkpoint`` or a generated tiny model; the SGLang test server on CPU), whose
  metrics give the step time, the weight-sync time and tokens/s per GPU.

On a machine without GPUs it says so and runs the CPU subset (GPU-only checks are ``skip``). The result is a
table and one JSON document (``--json``); exit 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from statistics import median
from typing import Optional

from megatron_kl.cli_help import Parser
from megatron_kl.config import ConfigError
from megatron_kl.launch.cli import submit
from megatron_kl.launch.experiment import LaunchPlan
from megatron_kl.launch.jobs import TaskSpec
from megatron_kl.train.config import load_train_config
from megatron_kl.train.metrics import read_metrics

CHECKS = ("gpu_tests", "layouts", "vocab_parallel", "fused_linear", "train")
TRAIN_STEPS = 3
TRAIN_RANKS = 2  # the training check's torchrun ranks (TP=2): tokens/s per GPU divides by this
DEFAULT_CONFIG = "configs/cpu/default.yaml"


@dataclass
class Check:
    name: str
    command: list[str]
    env: dict = field(default_factory=dict)
    skip: Optional[str] = None  # why it cannot run on this node
    timeout_s: float = 1800.0


@dataclass
class Result:
    name: str
    status: str  # pass | fail | skip
    seconds: float
    detail: str = ""
    command: str = ""


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]


def plan_checks(
    gpus: int, run_dir: Path, hf_checkpoint: Optional[str] = None, checkout: Optional[Path] = None
) -> list[Check]:
    kernel_world = 8 if gpus >= 8 else (2 if gpus == 0 else 0)
    kernel_skip = None if kernel_world else f"TP=8 needs 8 GPUs, this node has {gpus}"
    kernels_env = {"MEGATRON_KL_TEST_WORLDS": str(kernel_world)}
    layouts_skip = None if gpus == 0 or gpus >= 4 else f"TP=2 x PP=2 needs 4 GPUs, this node has {gpus}"
    gpu_tests = (
        _pytest("-m", "gpu", "tests", "megatron_kl/validation")
        if checkout is not None
        else _pytest("-m", "gpu", *_checks())
    )
    checks = [
        Check("gpu_tests", gpu_tests, skip=None if gpus else "no GPU on this node"),
        Check("layouts", _pytest(*_checks("test_model_layouts"), "-k", "tp2 or pp2"), skip=layouts_skip),
        Check(
            "vocab_parallel",
            _pytest(*_checks("test_vocab_parallel", "test_vocab_parallel_accuracy"), "-m", "not slow"),
            env=kernels_env,
            skip=kernel_skip,
        ),
        Check(
            "fused_linear", _pytest(*_checks("test_fused_linear"), "-m", "not slow"), env=kernels_env, skip=kernel_skip
        ),
    ]
    train_skip = None if gpus == 0 or gpus >= 3 else f"TP=2 training plus one SGLang GPU needs 3 GPUs, has {gpus}"
    checks.append(
        Check(
            "train",
            train_command(gpus, run_dir, hf_checkpoint),
            skip=train_skip,
            env={"OMP_NUM_THREADS": "1"} if gpus == 0 else {},
        )
    )
    return checks


def _checks(*modules: str) -> list[str]:
    """pytest arguments selecting the shipped check modules (all of them when none is named)."""
    return ["--pyargs", *([f"megatron_kl.validation.{m}" for m in modules] or ["megatron_kl.validation"])]


def train_command(gpus: int, run_dir: Path, hf_checkpoint: Optional[str]) -> list[str]:
    """3 steps at TP=2 with SGLang rollouts and NCCL (gloo on CPU) weight sync from the trainer's ranks."""
    from megatron_kl.rollout.servers import server_port

    overrides = [
        f"train.output_dir={run_dir}",
        f"train.steps={TRAIN_STEPS}",
        "parallel.tensor_parallel=2",
        f"rollout.sglang.port={server_port()}",
        "rollout.engine=sglang",
        "rollout.sglang.weight_sync=from_distributed",
        "rollout.sglang.colocated=false",
        "rollout.sglang.enable_memory_saver=false",
        "checkpoint.interval=0",
        "eval.interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "warm_start.enabled=false",
    ]  # the machinery is checked, not learning
    if gpus == 0:
        overrides += [
            "rollout.sglang.server_module=megatron_kl.testing.sglang_server",
            "train.prompts_per_step=8",
            "train.group_size=4",
            "task.eval_size=8",
            "eval.k=2",
        ]
    else:  # the server on the GPU after the trainer's two
        overrides += ["rollout.sglang.extra_args=[--base-gpu-id, '2']", "rollout.sglang.mem_fraction_static=0.5"]
        if hf_checkpoint:
            overrides += [f"init.hf_checkpoint={hf_checkpoint}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(TRAIN_RANKS),
        "--master-port",
        str(server_port()),
        "-m",
        "megatron_kl.cli",
        "train",
        "--config",
        str(packaged_config(DEFAULT_CONFIG)),
        *overrides,
    ]


def train_timings(metrics_path: Path, world: int) -> dict:
    """Median step time, weight-sync time and response tokens/s per GPU (per rank on CPU) of the run."""
    records = [r for r in read_metrics(metrics_path) if "time/step" in r] if metrics_path.is_file() else []
    if not records:
        return {}
    later = records[1:] or records  # step 0 includes the first compilation / warm-up
    return {
        "step_s": median(r["time/step"] for r in later),
        "weight_sync_s": median(r["time/weight_sync"] for r in later),
        "tokens_per_s_per_gpu": median(r["throughput/tokens_per_s"] for r in later) / world,
        "steps": len(records),
    }


def run_check(check: Check, root: Path, log_dir: Path) -> Result:
    command = shlex.join(check.command)
    if check.skip:
        return Result(check.name, "skip", 0.0, check.skip, command)
    log = log_dir / f"{check.name}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(
                check.command,
                cwd=root,
                env={**os.environ, **check.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=check.timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.perf_counter() - start
    if code == 0:
        return Result(check.name, "pass", seconds, str(log), command)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    why = f"timed out after {check.timeout_s:.0f}s" if code is None else f"exit code {code}"
    return Result(check.name, "fail", seconds, f"{why}; log {log}:\n{tail}", command)


def table(results: list[Result]) -> str:
    lines = [f"{'check':<16}{'status':<8}{'seconds':>9}  detail"]
    for r in results:
        first = r.detail.splitlines()[0] if r.detail else ""
        lines.append(f"{r.name:<16}{r.status:<8}{r.seconds:>9.1f}  {first}")
    return "\n".join(lines)


def validate(
    out_dir: Path, only: Optional[list[str]] = None, hf_checkpoint: Optional[str] = None, gpus: Optional[int] = None
) -> dict:
    gpus = gpu_count() if gpus is None else gpus
    out_dir.mkdir(parents=True, exist_ok=True)
    checkout = repository_checkout()
    checks = [c for c in plan_checks(gpus, out_dir / "train", hf_checkpoint, checkout) if not only or c.name in only]
    if gpus == 0:
        print(
            "validate: no GPU on this node: running the CPU subset (gloo, local layer spec, SGLang test server); "
            "GPU-only checks are skipped",
            file=sys.stderr,
        )
    results = []
    for check in checks:
        print(f"validate: {check.name} ...", file=sys.stderr, flush=True)
        results.append(run_check(check, checkout or out_dir, out_dir))
        print(f"validate: {check.name} {results[-1].status} ({results[-1].seconds:.1f}s)", file=sys.stderr)
    train = next((r for r in results if r.name == "train" and r.status == "pass"), None)
    report = {
        "node": os.uname().nodename,
        "gpus": gpus,
        "device": _device_name(gpus),
        "cpu_subset": gpus == 0,
        "passed": all(r.status != "fail" for r in results),
        "checks": [asdict(r) for r in results],
        "timings": train_timings(out_dir / "train" / "metrics.jsonl", TRAIN_RANKS) if train else {},
    }
    (out_dir / "validate.json").write_text(json.dumps(report, indent=2))
    return report


def _device_name(gpus: int) -> str:
    if not gpus:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)


def node_arguments(args) -> list[str]:
    """The ``megatron-kl validate`` arguments that travel to the node of a Slurm submission."""
    out = ["validate", "--out", args.out]
    for flag, value in (("--only", args.only), ("--hf-checkpoint", args.hf_checkpoint), ("--json", args.json)):
        if value:
            out += [flag, value]
    return out


def slurm_plan(args, cluster_overrides: list[str]):
    """One single-node Slurm job running ``megatron-kl validate`` there; the ``launch.slurm`` settings come from
    the cluster (and overrides), the rest of the config is the CPU default (the checks bring their own)."""
    overrides = [*cluster_overrides, *args.overrides, "launch.slurm.nodes=1", "launch.slurm.retries=0"]
    for item in args.overrides:
        if not item.startswith("launch."):
            raise ConfigError(f"validate takes launch.* overrides only, got {item!r}")
    cfg = load_train_config(str(packaged_config(DEFAULT_CONFIG)), overrides)
    task = TaskSpec("validate", DEFAULT_CONFIG, overrides, cfg, command=node_arguments(args))
    return LaunchPlan(cfg.launch.experiment or "megatron-kl-validate", [task], cfg.launch.home, True)


def parser(prog: str = "megatron-kl validate", clusters=None) -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__)
    p.add_argument("--out", default="runs/validate", help="logs, the training run and validate.json")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument(
        "--hf-checkpoint",
        default=None,
        help="GPU: an HF model for the training check (default: the CPU config's tiny model)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the JSON report to FILE (- : print it)")
    if clusters is not None:
        p.add_argument(
            "--cluster",
            choices=sorted(clusters),
            default=None,
            help="submit to this cluster of launch/clusters.py (a Slurm one) instead of running here",
        )
        p.add_argument("--dryrun", action="store_true", help="with --cluster: print the sbatch script")
        p.add_argument("--detach", action="store_true", help="with --cluster: return after submitting")
        p.add_argument("overrides", nargs="*", help="launch.* overrides for the submission")
    return p


def main(argv: list[str], clusters=None, prog: str = "megatron-kl validate") -> int:
    args = parser(prog, clusters).parse_args(argv)
    only = args.only.split(",") if args.only else None
    if only and set(only) - set(CHECKS):
        print(f"{prog}: --only {sorted(set(only) - set(CHECKS))} unknown; use {list(CHECKS)}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "cluster", None):
            cluster = clusters[args.cluster]()
            if cluster.executor != "slurm":
                raise ConfigError(f"--cluster {args.cluster} runs on this machine: drop --cluster")
            return submit("slurm", slurm_plan(args, cluster.overrides()), args.dryrun, args.detach, cluster.customize)
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return 2
    report = validate(Path(args.out).absolute(), only, args.hf_checkpoint)
    print(table([Result(**c) for c in report["checks"]]))
    text = json.dumps(report, indent=2)
    if args.json == "-":  # machine output only when asked for
        print(text)
    elif args.json:
        Path(args.json).write_text(text)
    print(f"{prog}: {'passed' if report['passed'] else 'FAILED'}; the report: {Path(args.out) / 'validate.json'}")
    return 0 if report["passed"] else 1


def repository_checkout() -> Optional[Path]:
    """The megatron-kl checkout this package is imported from (a checkout or an editable install), whose other
    ``gpu`` tests ``gpu_tests`` adds; None for an installed package (another checkout in the current directory
    is never mixed with it)."""
    candidate = Path(__file__).resolve().parents[2]
    return candidate if (candidate / "tests" / "e2e").is_dir() and (candidate / "configs").is_dir() else None


def packaged_config(relative: str) -> Path:
    """A config shipped with megatron-kl (``configs/...``): the checkout's file, or the installed package's copy."""
    checkout = repository_checkout()
    if checkout is not None and (checkout / relative).is_file():
        return checkout / relative
    path = Path(str(resources.files("megatron_kl.configs").joinpath(relative.removeprefix("configs/"))))
    if not path.is_file():
        raise ConfigError(
            f"{relative} is neither in a checkout nor in the installed package ({path}): reinstall megatron-kl"
        )
    return path
