"""`megatron-kl validate` from an installed package: the wheel built from this checkout, installed into a
directory of its own and run from a directory that is not a checkout, finds its checks
(megatron_kl.validation, through pytest --pyargs), its configs (megatron_kl.configs) and the C source of
its top-p search (built there) without tests/."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args, cwd, env, timeout=600):
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _tracked_copy(dest: Path) -> Path:
    """The checkout's tracked files only: a wheel built in place would also pack whatever a stale build/ directory
    still holds (a module since moved, say), which a clean clone does not have."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def test_validate_runs_from_an_installed_wheel(tmp_path):
    wheel_dir, site, elsewhere = tmp_path / "wheel", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    source_tree = _tracked_copy(tmp_path / "source")
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            str(source_tree),
        ],
        source_tree,
        os.environ,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheel_dir.glob("megatron_kl-*.whl")
    installed = _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], ROOT, os.environ
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert not (site / "tests").exists()
    env = {**os.environ, "PYTHONPATH": str(site)}

    where = _run(
        [
            sys.executable,
            "-c",
            "import megatron_kl; from megatron_kl.launch.node_check import "
            "packaged_config, repository_checkout; print(megatron_kl.__file__); print(repository_checkout()); "
            "print(packaged_config('configs/cpu/default.yaml'))",
        ],
        elsewhere,
        env,
    )
    module, checkout, config = where.stdout.split()
    assert module.startswith(str(site)) and checkout == "None" and config.startswith(str(site)), where.stdout

    kernels = _run(
        [
            sys.executable,
            "-c",
            "from megatron_kl.vocab_parallel import native; print(native.SOURCE); print(native.library() is not None)",
        ],
        elsewhere,
        {**env, "MEGATRON_KL_CACHE": str(tmp_path / "c")},
    )
    assert kernels.returncode == 0, kernels.stderr[-2000:]
    source, loaded = kernels.stdout.split()
    assert source.startswith(str(site)) and loaded == "True", kernels.stdout + kernels.stderr[-2000:]

    checked = _run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "train",
            "--check",
            "--config",
            config,
            f"train.output_dir={tmp_path / 'run'}",
        ],
        elsewhere,
        env,
    )
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert not (tmp_path / "run").exists()

    out = tmp_path / "out"
    validated = _run(
        [sys.executable, "-m", "megatron_kl.cli", "validate", "--only", "vocab_parallel", "--out", str(out)],
        elsewhere,
        env,
    )
    assert validated.returncode == 0, validated.stdout[-3000:] + validated.stderr[-3000:]
    report = json.loads((out / "validate.json").read_text())
    (check,) = report["checks"]
    assert report["passed"] and check["status"] == "pass" and "--pyargs megatron_kl.validation" in check["command"]
    log = Path(check["detail"]).read_text()
    assert " passed" in log and " failed" not in log, log[-2000:]
