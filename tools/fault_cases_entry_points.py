"""The fault review's cases beyond ``megatron-kl train`` (imported by tools/fault_review.py): the study, launch local
and convert entry points, values checked against what they refer to, secrets, exit codes of the rollout paths,
damaged shipped files and environment variables. Each is judged by its outcome only, like the trainer's cases."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

SECRET = "planted-key-5d1e07c3"
SHORT: list[str] = []  # fault_review's short-run overrides (set by :func:`cases`)
SERVED = ["rollout.engine=sglang", "rollout.sglang.server_module=megatron_kl.testing.sglang_server"]


def _cli(r, *args, env=None, timeout=600) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-m", "megatron_kl.cli", *args],
        cwd=r.repo,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )


def _port() -> str:
    from megatron_kl.rollout.servers import server_port

    return f"rollout.sglang.port={server_port()}"


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [
        json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip() and '"reward/mean"' in line
    ]


# -- the study ---------------------------------------------------------------------------------------------------
def _study_file(r, name: str, **changes) -> Path:
    data = {
        "name": name,
        "base": str(r.repo / "configs/cpu/default.yaml"),
        "output_dir": str(r.work / name),
        "seeds": [1],
        "common": [*SHORT, f"warm_start.cache_dir={r.cache}", "train.steps=6", "checkpoint.interval=1"],
        "configurations": [{"name": "k3", "overrides": ["kl.estimator=k3", "kl.placement=loss"]}],
    }
    data.update(changes)
    path = r.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _kill_9_after_two_steps(r, args: list[str], run: Path) -> list:
    """Start ``megatron-kl *args``, kill it -9 once ``run`` logged two steps; the descendants still alive 20 s later
    (killed then, so the review leaves nothing behind)."""
    environ = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_kl.cli", *args],
        cwd=r.repo,
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while len(_steps(run)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=20)
    for p in alive:
        p.kill()
    return alive


def study_kill_9(r) -> None:
    name = "killed study, rerun at once"
    path = _study_file(
        r, "study-kill9", common=[*SHORT, f"warm_start.cache_dir={r.cache}", "train.steps=30", "checkpoint.interval=1"]
    )
    out = r.work / "study-kill9"
    run = out / "runs" / "k3-seed1"
    alive = _kill_9_after_two_steps(r, ["study", "--config", str(path)], run)
    finished_alone = (run / "summary.json").is_file()  # the orphan trained the run to its end
    again = _cli(r, "study", "--config", str(path))
    status = json.loads((out / "status.json").read_text()) if (out / "status.json").is_file() else {}
    state = status.get("k3-seed1", {}).get("state")
    if alive or finished_alone:
        r.record(name, "leaked", f"the trainer outlived the study (parent 1); rerun rc {again.returncode}, run {state}")
    elif again.returncode == 0 and state == "ok" and _steps(run) == list(range(30)):
        r.record(name, "handled", "the trainer died with it; the rerun resumed it, every step once")
    else:
        r.record(name, "unclear", f"rerun rc {again.returncode}, run {state}, steps {_steps(run)}")


def _study_setting(label: str, field: str, **changes):
    def case(r) -> None:
        name = f"study {label}"
        path = _study_file(r, f"study-setting-{abs(hash(label)) % 10**6}", **changes)
        done = _cli(r, "study", "--config", str(path), "--report-only")
        if done.returncode == 2 and field in done.stderr and "Traceback" not in done.stderr:
            r.record(name, "handled", f"rc 2: {done.stderr.strip().splitlines()[-1][-90:]}")
        elif done.returncode == 0:
            r.record(name, "silent", "rc 0: the claims computed under it")
        else:
            r.record(name, "unclear", f"rc {done.returncode}: {done.stderr.strip().splitlines()[-1][-90:]}")

    case.__name__ = f"study setting {label}"
    return case


def study_report_only_unfinished(r) -> None:
    name = "study --report-only before any run"
    path = _study_file(r, "study-unfinished")
    done = _cli(r, "study", "--config", str(path), "--report-only")
    results = r.work / "study-unfinished" / "results.json"
    row = json.loads(results.read_text()).get("k3", {}) if results.is_file() else {}
    if row.get("failed") == [] and row.get("not_run") == ["k3-seed1"] and done.returncode == 1:
        r.record(name, "handled", "the run shown as not run, nothing computed from it")
    else:
        r.record(name, "silent", f"rc {done.returncode}: the run that never ran counted as failed {row.get('failed')}")


# -- launch local and convert -----------------------------------------------------------------------------------
def launch_local_kill_9(r) -> None:
    name = "kill -9 of launch local"
    out = r.work / "launch-kill9"
    alive = _kill_9_after_two_steps(
        r,
        [
            "launch",
            "local",
            "--config",
            str(r.repo / "configs/cpu/default.yaml"),
            *SHORT,
            f"warm_start.cache_dir={r.cache}",
            "train.steps=40",
            "checkpoint.interval=0",
            f"train.output_dir={out}",
            f"launch.home={r.work / 'launch-home'}",
            "parallel.tensor_parallel=2",
        ],
        out,
    )
    if alive or len(_steps(out)) == 40:
        r.record(name, "leaked", f"torchrun and its ranks trained on without it ({len(_steps(out))} of 40 steps)")
    else:
        saved = list((out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
        r.record(name, "handled", f"torchrun and its ranks stopped, {len(saved)} checkpoint(s) of the finished steps")


def _hf_dir(r) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.distributed.hf_workers import make_hf_model

    target = r.work / "hf-intact"
    if not target.exists():
        make_hf_model("qwen2", target, seed=0)
    return target


def _convert_case(label: str, damage, named: str):
    def case(r) -> None:
        name = f"convert --hf with {label}"
        broken = r.work / f"hf-{abs(hash(label)) % 10**6}"
        shutil.copytree(_hf_dir(r), broken)
        damage(broken)
        done = _cli(r, "convert", "--hf", str(broken), "--out", str(broken.with_suffix(".out")))
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        if done.returncode == 0:
            r.record(name, "silent", "rc 0: converted")
        elif "Traceback" not in done.stderr and named in last:
            r.record(name, "handled", f"rc {done.returncode}: {last[-100:]}")
        else:
            r.record(name, "unclear", f"rc {done.returncode}, traceback: {'Traceback' in done.stderr}: {last[-90:]}")

    case.__name__ = f"convert {label}"
    return case


def _truncate_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _break_config(d: Path) -> None:
    (d / "config.json").write_text((d / "config.json").read_text()[:-20])


def _double_hidden(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["hidden_size"] *= 2
    (d / "config.json").write_text(json.dumps(config))


# -- secrets, rollout exit codes ---------------------------------------------------------------------------------
def _leaks(run: Path, output: str) -> list[str]:
    """Where the planted key stands in clear: files under the run, the trainer's output."""
    found = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes())
    return found + (["the trainer's output"] if SECRET in output else [])


def secret_in_server_flags(r) -> None:
    name = "a secret server flag in rollout.sglang.extra_args"
    run = r.work / "secret-flag"
    code, out = r.run(run, "train.steps=1", *SERVED, _port(), f"rollout.sglang.extra_args=[--admin-api-key, {SECRET}]")
    leaks = _leaks(run, out)
    if leaks:
        r.record(name, "silent", f"rc {code}; the key in clear in {', '.join(leaks[:4])}")
    elif code == 0:
        r.record(name, "handled", "trained; the key in no file or line written")
    else:
        r.record(name, "unclear", f"rc {code}")


def api_key_in_extra_args(r) -> None:
    name = "--api-key in rollout.sglang.extra_args"
    run = r.work / "secret-api-key"
    code, out = r.run(run, "train.steps=1", *SERVED, _port(), f"rollout.sglang.extra_args=[--api-key, {SECRET}]")
    leaks = _leaks(run, out)
    if leaks:
        r.record(name, "silent", f"rc {code}; the key in clear in {', '.join(leaks[:3])}")
    elif code == 2 and "api_key_env" in out:
        r.record(name, "handled", "refused, pointing to rollout.sglang.api_key_env, the key not repeated")
    else:
        r.record(name, "unclear", f"rc {code}")


def _partial(r) -> list[str]:
    return [
        *SERVED,
        _port(),
        "rollout.partial=true",
        "train.staleness=2",
        "rollout.sglang.weight_sync=from_disk",
        "rollout.sampling.max_new_tokens=12",
    ]


def partial_server_lost_in_update(r) -> None:
    name = "partial rollouts: server lost during a weight update"
    run = r.work / "partial-lost"
    marker = r.work / "partial-lost.marker"
    code, out = r.run(
        run,
        "train.steps=6",
        "checkpoint.interval=0",
        *_partial(r),
        "rollout.sglang.restart_dead_servers=false",
        "rollout.sglang.max_retries=1",
        "rollout.sglang.backoff_s=0.05",
        f"rollout.sglang.extra_args=[--fault-exit-on-update, '3', --fault-marker, '{marker}', "
        "--token-latency-s, '0.1', --long-every, '3']",
    )
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if code == 75 and "rollout engine lost" in last:
        r.record(name, "handled", "checkpoint of the finished steps, rc 75 (requeue)")
    else:
        r.record(name, "unclear", f"rc {code} (the table says 75): {last[-100:]}")


def partial_sigterm_in_checkpoint(r) -> None:
    name = "partial rollouts: SIGTERM during a checkpoint write"
    run = r.work / "partial-term"
    proc = r.start(
        run,
        "train.steps=30",
        "checkpoint.interval=1",
        *_partial(r),
        "rollout.sglang.extra_args=[--token-latency-s, '0.1', --long-every, '3']",
    )
    writing = run / "checkpoints" / "step_000002.tmp"
    deadline = time.time() + 300
    while not writing.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=300)
    out = (r.work / f"{run.name}.log.txt").read_text(errors="replace")
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if code == 75 and "failed" not in last:
        r.record(name, "handled", "checkpoint of the finished steps, rc 75")
    else:
        r.record(name, "unclear", f"rc {code}: {last[-110:]}")


# -- shipped files, environment variables ----------------------------------------------------------------------
def _with_manifest(r, change):
    """Run ``change(manifest path)`` on the reviewed checkout's shipped manifest, restored afterwards."""
    manifest = r.repo / "megatron_kl/data/warm_starts/manifest.json"
    saved = manifest.read_bytes()
    try:
        change(manifest)
        return r.run(
            r.work / f"manifest-{abs(hash(change)) % 10**6}",
            "train.steps=1",
            f"warm_start.cache_dir={r.work / 'manifest-cache'}",
        )
    finally:
        manifest.write_bytes(saved)


def damaged_manifest(r) -> None:
    name = "a damaged shipped warm-start manifest"
    code, out = _with_manifest(r, lambda m: m.write_text(m.read_text()[:40]))
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if code == 2 and "manifest" in last and "Traceback" not in out:
        r.record(name, "handled", f"rc 2: {last[-100:]}")
    else:
        r.record(name, "unclear", f"rc {code}, traceback: {'Traceback' in out}: {last[-80:]}")


def deleted_manifest(r) -> None:
    name = "a deleted shipped warm-start manifest (source=auto)"
    code, out = _with_manifest(r, lambda m: m.unlink())
    if "shipped warm starts are missing" in out:
        r.record(name, "handled", f"rc {code}; the fallback (training it) stated")
    else:
        r.record(name, "silent", f"rc {code}: retrained the warm start without a word")


def _bad_env(variable: str, value: str):
    def case(r) -> None:
        name = f"{variable}={value}"
        done = _cli(
            r,
            "train",
            "--config",
            str(r.repo / "configs/cpu/default.yaml"),
            "--check",
            f"train.output_dir={r.work / 'env-check'}",
            env={variable: value},
        )
        if done.returncode == 2 and variable in done.stderr and "Traceback" not in done.stderr:
            r.record(name, "handled", "refused at --check naming the variable")
        elif done.returncode == 0:
            r.record(name, "silent", "--check OK: the value is read as something else at run time")
        else:
            r.record(name, "unclear", f"rc {done.returncode}, traceback: {'Traceback' in done.stderr}")

    case.__name__ = f"environment {variable}={value}"
    return case


def cases(bad_value, short: list[str]) -> list:
    SHORT[:] = short
    return [
        study_kill_9,
        _study_setting("instability_factor: .nan", "instability_factor", instability_factor=float("nan")),
        _study_setting("collapse_fraction: 2", "collapse_fraction", collapse_fraction=2),
        _study_setting("seeds: []", "seeds", seeds=[]),
        _study_setting("seeds: [1, 1]", "seeds", seeds=[1, 1]),
        study_report_only_unfinished,
        launch_local_kill_9,
        _convert_case("a truncated safetensors file", _truncate_weights, "model.safetensors"),
        _convert_case("a malformed config.json", _break_config, "config.json"),
        _convert_case("a config.json whose hidden_size disagrees", _double_hidden, "hidden_size"),
        bad_value("rollout.sampling.stop_token_ids=[999]", field="stop_token_ids"),
        bad_value("rollout.sampling.stop_token_ids=[-1]", field="stop_token_ids"),
        bad_value("train.seed=1.0e+23", field="train.seed"),
        bad_value("parallel.distributed_timeout_s=1e-9", field="distributed_timeout_s"),
        bad_value("rollout.sampling.max_new_tokens=25", field="max_new_tokens"),
        bad_value("warm_start.source=shipped", "warm_start.enabled=false", field="warm_start"),
        secret_in_server_flags,
        api_key_in_extra_args,
        partial_server_lost_in_update,
        partial_sigterm_in_checkpoint,
        damaged_manifest,
        deleted_manifest,
        _bad_env("MEGATRON_KL_TRITON", "abc"),
        _bad_env("MEGATRON_KL_TRITON", "-1"),
        _bad_env("MEGATRON_KL_TRITON_BLOCK", "abc"),
    ]
