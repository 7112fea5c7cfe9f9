"""Fault review: inject faults and bad inputs into short CPU runs of ``megatron-kl train`` and classify each
outcome against what a user must get.

    python tools/fault_review.py [--repo DIR] [--only name,name] [--json out.json]

``--repo`` runs the trainer of another checkout (e.g. a ``git worktree`` of an older commit, with this
environment's packages): the same faults, before and after a change. Every case is judged by its outcome only
(exit code, output, files, processes), never by the code's internals:

* handled - the run did what the table in docs/checkpoints.md says (the right exit code, the file or field
  named, the result correct, nothing lost);
* unclear - it stopped, but the message does not name what is wrong (or advises something harmful);
* silent  - it exited 0 (or went on) with a wrong result, lost data, or ran planted code;
* leaked  - a process of the run outlived it.

The trainer's cases are here; those of the other entry points (study, launch local, convert), of values checked
against what they refer to, secrets, the rollout paths' exit codes, damaged shipped files and environment variables
are in tools/fault_cases_entry_points.py.

Prints one line per case and the table (tried / handled / unclear / silent / leaked).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from fault_cases_entry_points import cases as entry_point_cases

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "train.prompts_per_step=4",
    "train.group_size=4",
    "task.eval_size=8",
    "eval.k=2",
    "eval.interval=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.keep=3",
]


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Review:
    def __init__(self, repo: Path, work: Path):
        self.repo, self.work = repo, work
        self.cache = work / "cache"
        self.rows: list[tuple[str, str, str]] = []

    # -- running -------------------------------------------------------------------------------------
    def start(self, run: Path, *overrides: str, log: str = "log") -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONWARNINGS"] = "ignore"
        out = open(self.work / f"{run.name}.{log}.txt", "w")
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_kl.cli",
                "train",
                "--config",
                str(self.repo / "configs/cpu/default.yaml"),
                f"train.output_dir={run}",
                f"warm_start.cache_dir={self.cache}",
                *SHORT,
                *overrides,
            ],
            cwd=self.repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def run(self, run: Path, *overrides: str, log: str = "log", timeout: float = 600) -> tuple[int, str]:
        proc = self.start(run, *overrides, log=log)
        code = proc.wait(timeout=timeout)
        return code, (self.work / f"{run.name}.{log}.txt").read_text(errors="replace")

    def base(self) -> Path:
        base = self.work / "base"
        if not base.exists():
            code, out = self.run(base, "train.steps=2", "checkpoint.interval=1")
            assert code == 0, out[-2000:]
        return base

    def copy(self, name: str) -> Path:
        target = self.work / name
        shutil.copytree(self.base(), target)
        return target

    def record(self, name: str, verdict: str, why: str) -> None:
        self.rows.append((name, verdict, why))
        print(f"{verdict:8s} {name}: {why}", flush=True)


# -- cases --------------------------------------------------------------------------------------------
def _shard(run: Path) -> Path:
    ckpt = run / "checkpoints" / "step_000002"
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _damage_case(name: str, damage):
    def case(r: Review) -> None:
        run = r.copy(name)
        file_name = damage(run / "checkpoints" / "step_000002")
        code, out = r.run(run, "train.steps=3", "checkpoint.interval=1")
        fell_back = "resumed from" in out and "step_000001 at RL step 1" in out
        if code == 0 and not fell_back:
            r.record(name, "silent", "resumed from the damaged checkpoint")
        elif fell_back and file_name in out:
            r.record(name, "handled", f"named {file_name}, fell back to step 1")
        else:
            r.record(name, "unclear", f"rc {code}; the damaged file {file_name} not named")

    case.__name__ = name
    return case


def _flip(ckpt: Path) -> str:
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    rng = random.Random(0)
    for i in rng.sample(range(len(raw) // 4, 3 * len(raw) // 4), 64):
        raw[i] ^= 1 << rng.randrange(8)
    shard.write_bytes(bytes(raw))
    return shard.name


def _overwrite(data: bytes):
    def damage(ckpt: Path) -> str:
        shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2 : len(raw) // 2 + len(data)] = data
        shard.write_bytes(bytes(raw))
        return shard.name

    return damage


def _truncate(ckpt: Path) -> str:
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard.name


def _zero_trainer(ckpt: Path) -> str:
    path = ckpt / "trainer.pt"
    path.write_bytes(bytes(path.stat().st_size))
    return "trainer.pt"


def planted_pickle(r: Review) -> None:
    for target in (".metadata", "trainer.pt", "common.pt"):
        run = r.copy(f"pickle-{target.strip('.')}")
        marker = r.work / f"pwned-{target.strip('.')}"
        (run / "checkpoints" / "step_000002" / target).write_bytes(pickle.dumps(Payload(str(marker))))
        code, out = r.run(run, "train.steps=3", "checkpoint.interval=1")
        if marker.exists():
            r.record(f"planted pickle in {target}", "silent", "the planted pickle ran")
        elif "step_000001 at RL step 1" in out:
            r.record(f"planted pickle in {target}", "handled", "not run; fell back to step 1")
        else:
            r.record(f"planted pickle in {target}", "unclear", f"not run; rc {code}")


def _refused_change(name: str, *overrides: str, field: str):
    def case(r: Review) -> None:
        run = r.copy(name)
        before = sorted((str(p), p.stat().st_size) for p in run.rglob("*") if p.is_file())
        code, out = r.run(run, "train.steps=2", "checkpoint.interval=1", *overrides)
        after = sorted((str(p), p.stat().st_size) for p in run.rglob("*") if p.is_file())
        if code == 0:
            r.record(name, "silent", "rc 0: the old run's results reported as this one's")
        elif code == 2 and field in out and before == after and "delete them" not in out:
            r.record(name, "handled", f"rc 2 naming {field}; directory unchanged")
        else:
            r.record(name, "unclear", f"rc {code}; field named: {field in out}; unchanged: {before == after}")

    case.__name__ = name
    return case


def finished_rerun(r: Review) -> None:
    run = r.copy("finished")
    code, out = r.run(run, "train.steps=2", "checkpoint.interval=1")
    if code == 0 and "already finished" in out:
        r.record("re-run of a finished run", "handled", "says already finished")
    else:
        r.record("re-run of a finished run", "unclear", f"rc {code}; prints done as if it trained")


def fresh_start_on_used_dir(r: Review) -> None:
    run = r.copy("fresh-start")
    code, out = r.run(run, "train.steps=1", "checkpoint.interval=1", "checkpoint.resume=false", "kl.coef=0.05")
    old_kept = any(p.name == "step_000002" for p in run.rglob("step_*"))
    code2, out2 = r.run(run, "train.steps=2", "checkpoint.interval=1", "kl.coef=0.05", log="next")
    resumed_new = "step_000001 at RL step 1" in out2
    if code == 0 and old_kept and resumed_new:
        r.record(
            "checkpoint.resume=false on a used directory",
            "handled",
            "old files kept aside; next start resumes the new run",
        )
    else:
        r.record(
            "checkpoint.resume=false on a used directory",
            "silent",
            f"old checkpoints kept: {old_kept}; next start resumed the new run: {resumed_new}",
        )


def two_writers(r: Review) -> None:
    run = r.work / "two-writers"
    first = r.start(run, "train.steps=40", "checkpoint.interval=0", log="first")
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").is_file() and time.time() < deadline and first.poll() is None:
        time.sleep(0.1)
    code, out = r.run(run, "train.steps=40", "checkpoint.interval=0", log="second", timeout=600)
    first.send_signal(signal.SIGKILL)
    first.wait()
    if code == 2 and "in use" in out:
        r.record("two trainers on one directory", "handled", "second refused naming the holder")
    else:
        r.record("two trainers on one directory", "silent", f"second ran (rc {code})")


def kill_9_orphans(r: Review) -> None:
    run = r.work / "kill9"
    proc = r.start(run, "train.steps=40", "checkpoint.interval=1")
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_000001").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    if alive:
        r.record("kill -9 of the trainer", "leaked", f"{len(alive)} helper process(es) outlived it")
    else:
        r.record("kill -9 of the trainer", "handled", f"{len(children)} helper(s) died with it")


def _signal_case(sig: signal.Signals, code_wanted: int):
    def case(r: Review) -> None:
        run = r.work / f"signal-{sig.name}"
        proc = r.start(run, "train.steps=40", "checkpoint.interval=0")
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.is_file() and '"loss/total"' in metrics.read_text(errors="replace"):
                break
            time.sleep(0.05)
        proc.send_signal(sig)
        code = proc.wait(timeout=300)
        out = (r.work / f"{run.name}.log.txt").read_text(errors="replace")
        saved = list((run / "checkpoints").glob("step_*")) if (run / "checkpoints").is_dir() else []
        name = f"{sig.name} during training"
        if code == code_wanted and saved and sig.name in out:
            r.record(name, "handled", f"checkpoint {saved[0].name}, rc {code}")
        elif not saved:
            r.record(name, "silent", f"rc {code}; no checkpoint: finished steps lost")
        else:
            r.record(name, "unclear", f"rc {code}; signal named: {sig.name in out}")

    case.__name__ = f"signal_{sig.name}"
    return case


def temperature_zero(r: Review) -> None:
    code, out = r.run(r.work / "temperature0", "train.steps=1", "rollout.sampling.temperature=0")
    if code == 2 and "rollout.sampling.temperature" in out:
        r.record("rollout.sampling.temperature=0", "handled", "refused naming the field")
    else:
        r.record("rollout.sampling.temperature=0", "silent", f"rc {code}: trains with a zero gradient")


def _bad_value(*overrides: str, field: str):
    """A config value that must be refused before anything starts: rc 2, one line naming the field."""
    name = " ".join(overrides)

    def case(r: Review) -> None:
        run = r.work / f"bad-{abs(hash(name)) % 10**8}"
        start = time.time()
        code, out = r.run(run, "train.steps=1", *overrides)
        seconds = time.time() - start
        lines = [line for line in out.splitlines() if "config error" in line]
        if code == 0:
            r.record(name, "silent", "rc 0: trained with it")
        elif (
            code == 2
            and lines
            and field in lines[-1]
            and "Traceback" not in out
            and not (run / "metrics.jsonl").exists()
        ):
            r.record(name, "handled", f"rc 2 in {seconds:.0f} s: {lines[-1].split('config error: ')[-1][:90]}")
        else:
            r.record(
                name,
                "unclear",
                f"rc {code} after {seconds:.0f} s; field named in one line: {bool(lines)}; "
                f"traceback: {'Traceback' in out}",
            )

    case.__name__ = f"bad value {name}"
    return case


def duplicate_key(r: Review) -> None:
    config = r.work / "twice.yaml"
    text = (r.repo / "configs/cpu/default.yaml").read_text()
    config.write_text(text + "\nkl:\n  coef: 0.5\n")  # a second top-level kl: section
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_kl.cli",
            "train",
            "--config",
            str(config),
            "--check",
            f"train.output_dir={r.work / 'twice'}",
            f"warm_start.cache_dir={r.cache}",
        ],
        cwd=r.repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 2 and "twice" in proc.stderr:
        r.record("a YAML key given twice", "handled", "refused naming the key and its lines")
    elif proc.returncode == 0:
        r.record("a YAML key given twice", "silent", "--check OK: the last value silently wins")
    else:
        r.record("a YAML key given twice", "unclear", f"rc {proc.returncode}")


def damaged_warm_start_cache(r: Review) -> None:
    cache = r.work / "own-cache"
    args = [f"warm_start.cache_dir={cache}", "warm_start.steps=40", "train.steps=1"]
    first = r.work / "cache-a"
    code, out = r.run(first, *args, "train.steps=1")
    weights = next(iter(sorted(cache.glob("warmstart-*.pt"))), None)
    if code != 0 or weights is None:
        r.record("bit-flipped warm-start cache", "unclear", f"the first run failed (rc {code})")
        return
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    code, out = r.run(r.work / "cache-b", *args, log="second")
    kl = [
        [
            m.get("kl/exact_token")
            for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
            if "kl/exact_token" in m
        ]
        for d in (first, r.work / "cache-b")
    ]
    if code == 0 and "recomputing" in out and kl[0] == kl[1]:
        r.record("bit-flipped warm-start cache", "handled", "digest mismatch said; recomputed; same KL as before")
    elif code == 0 and kl[0] != kl[1]:
        r.record("bit-flipped warm-start cache", "silent", "loaded: policy and reference from damaged weights")
    else:
        r.record("bit-flipped warm-start cache", "unclear", f"rc {code}")


def engine_error_mid_run(r: Review) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = r.work / "engine-error"
    code, out = r.run(
        run,
        "train.steps=6",
        "checkpoint.interval=0",
        "rollout.engine=sglang",
        "rollout.sglang.server_module=megatron_kl.testing.sglang_server",
        f"rollout.sglang.port={port}",
        "rollout.sglang.extra_args=[--fault-malformed-every,70]",
    )
    trained = (
        [
            json.loads(line)["step"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss/total"' in line
        ]
        if (run / "metrics.jsonl").is_file()
        else []
    )
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*")) if (run / "checkpoints").is_dir() else []
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if code == 0 or not trained:
        r.record("malformed engine answer mid-run", "unclear", f"rc {code}; steps trained before it: {trained}")
    elif saved and saved[-1] == f"step_{len(trained):06d}" and saved[-1] in last:
        r.record(
            "malformed engine answer mid-run", "handled", f"{len(trained)} trained steps saved, named in the last line"
        )
    else:
        r.record(
            "malformed engine answer mid-run", "silent", f"{len(trained)} trained steps, checkpoints {saved}: lost"
        )


def damaged_run_record(r: Review) -> None:
    run = r.copy("run-json")
    record = run / "checkpoints" / "step_000002" / "run.json"
    record.write_text(record.read_text().replace('"kl.coef": 0.01', '"kl.coef": 0.02', 1))
    code, out = r.run(run, "train.steps=3", "checkpoint.interval=1")
    starts = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines()]
    if code == 0 and "step_000001 at RL step 1" in out and "run.json" in out and starts[-1]["from_step"] == 1:
        r.record("an edited run.json in the newest checkpoint", "handled", "named, fell back to step 1, recorded so")
    elif code == 2:
        r.record("an edited run.json in the newest checkpoint", "unclear", "refused as a configuration change")
    else:
        r.record(
            "an edited run.json in the newest checkpoint",
            "unclear",
            f"rc {code}; starts.jsonl from_step {starts[-1].get('from_step')}",
        )


def renamed_checkpoint(r: Review) -> None:
    run = r.copy("renamed")
    (run / "checkpoints" / "step_000002").rename(run / "checkpoints" / "step_000005")
    code, out = r.run(run, "train.steps=6", "checkpoint.interval=1")
    if code == 0 and "step_000001 at RL step 1" in out:
        r.record("a checkpoint renamed to a later step", "handled", "not used; resumed from step 1")
    elif "at RL step 2" in out or "step_000005" in out.split("resumed from")[-1][:200]:
        r.record("a checkpoint renamed to a later step", "silent", "resumed from it as if it were step 5")
    else:
        r.record("a checkpoint renamed to a later step", "unclear", f"rc {code}")


def stop_during_warm_start(r: Review) -> None:
    run = r.work / "warm-stop"
    proc = r.start(run, f"warm_start.cache_dir={r.work / 'warm-stop-cache'}", "warm_start.steps=2000")
    log_file = r.work / f"{run.name}.log.txt"
    deadline = time.time() + 300
    while (
        "warm start step" not in log_file.read_text(errors="replace") and time.time() < deadline and proc.poll() is None
    ):
        time.sleep(0.05)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    seconds = time.time() - sent
    if code == 75 and seconds < 20:
        r.record("SIGTERM during the warm start", "handled", f"rc 75 after {seconds:.1f} s")
    else:
        r.record(
            "SIGTERM during the warm start", "unclear", f"rc {code} after {seconds:.0f} s (grace periods: 30-120 s)"
        )


CASES = [
    _damage_case("64 flipped bits in a shard", _flip),
    _damage_case("4 KB of zeros in a shard", _overwrite(bytes(4096))),
    _damage_case("4 KB of random bytes in a shard", _overwrite(random.Random(1).randbytes(4096))),
    _damage_case("truncated shard", _truncate),
    _damage_case("zeroed trainer.pt", _zero_trainer),
    planted_pickle,
    _refused_change("resume with another estimator", "kl.estimator=k3", "kl.placement=loss", field="kl.estimator"),
    _refused_change("resume with another lr", "optim.lr=0.001", field="optim.lr"),
    _refused_change("resume with another hidden size", "model.ffn_hidden_size=96", field="model.ffn_hidden_size"),
    finished_rerun,
    fresh_start_on_used_dir,
    two_writers,
    kill_9_orphans,
    _signal_case(signal.SIGINT, 130),
    _signal_case(signal.SIGHUP, 75),
    temperature_zero,
    _bad_value("kl.coef=nan", field="kl.coef"),
    _bad_value("rollout.sampling.temperature=nan", field="rollout.sampling.temperature"),
    _bad_value("optim.lr_decay_style=cosine", "optim.decay_steps=0", field="optim.decay_steps"),
    _bad_value("warm_start.steps=-1", field="warm_start.steps"),
    _bad_value("optim.clip_grad=-1", field="optim.clip_grad"),
    _bad_value("train.steps=true", field="train.steps"),
    _bad_value("train.output_dir=", field="train.output_dir"),
    _bad_value("optim.lr=-1", field="optim.lr"),
    _bad_value("optim.lr=nan", field="optim.lr"),
    _bad_value("kl.coef=inf", field="kl.coef"),
    _bad_value("optim.adam_beta1=1.5", field="optim.adam_beta1"),
    _bad_value("optim.adam_eps=0", field="optim.adam_eps"),
    _bad_value("optim.lr_decay_style=bogus", field="optim.lr_decay_style"),
    _bad_value("warm_start.checkpoint=/no/such/file.pt", field="warm_start.checkpoint"),
    _bad_value("rollout.sampling.max_new_tokens=40", field="max_new_tokens"),
    _bad_value("warm_start.cache_dir=/dev/null", field="warm_start.cache_dir"),
    _bad_value("optim.warmup_steps=-3", field="optim.warmup_steps"),
    duplicate_key,
    damaged_warm_start_cache,
    engine_error_mid_run,
    damaged_run_record,
    renamed_checkpoint,
    stop_during_warm_start,
]
CASES += entry_point_cases(_bad_value, SHORT)  # study, launch local, convert, secrets, rollout exit codes, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(ROOT), help="checkout whose trainer is run (default: this one)")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        review = Review(Path(args.repo).resolve(), Path(tmp))
        for case in CASES:
            if args.only and not any(s in case.__name__ for s in args.only.split(",")):
                continue
            try:
                case(review)
            except Exception as err:  # noqa: BLE001 - a case that cannot be judged is reported, not fatal
                review.record(case.__name__, "unclear", f"the review itself failed: {type(err).__name__}: {err}")
    counts = {
        v: sum(1 for _, verdict, _ in review.rows if verdict == v) for v in ("handled", "unclear", "silent", "leaked")
    }
    print(f"\ntried {len(review.rows)} | " + " | ".join(f"{k} {v}" for k, v in counts.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": review.rows, "counts": counts}, indent=1))


if __name__ == "__main__":
    main()
