"""Ctrl-C, a closed terminal and preemption end a run with a checkpoint of its finished steps and one line naming
the signal - also while the rollout server hangs, within seconds instead of the retry budget."""

import signal
import time
from pathlib import Path

import pytest

from megatron_kl.rollout.servers import server_port
from megatron_kl.run.checkpoint import complete_checkpoints
from megatron_kl.train.metrics import read_metrics
from tests.e2e.runs import DEFAULT, Run
from tests.e2e.test_sglang import TEST_SERVER

COMMON = [
    "train.prompts_per_step=4",
    "train.group_size=4",
    "task.eval_size=8",
    "eval.k=2",
    "eval.interval=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.interval=0",
    "train.steps=40",
]


def _trained(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path) if "loss/total" in r] if path.is_file() else []


def _wait_for(condition, proc, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None and time.time() < deadline, "the run ended (or took too long) before the signal"
        time.sleep(0.05)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGHUP, 75)], ids=["SIGINT", "SIGHUP"])
def test_ctrl_c_and_hangup_checkpoint_the_finished_steps(tmp_path, warm_cache, sig, code):
    run = tmp_path / "run"
    job = Run(
        tmp_path / "log.txt",
        "--config",
        str(DEFAULT),
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        *COMMON,
    )
    _wait_for(lambda: len(_trained(run)) >= 1, job.proc)
    job.proc.send_signal(sig)
    rc, output = job.wait(120)
    assert rc == code, output[-3000:]
    assert f"received {sig.name}" in output and "Traceback" not in output, output[-3000:]
    finished = len(_trained(run))
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == [f"step_{finished:06d}"]


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_stop_signal_during_a_hung_rollout_is_honoured_within_seconds(tmp_path, warm_cache, staleness):
    """The server stops answering /generate after 72 requests (48 of the step-0 evaluation, 16 of step 0, half of step
    1; connections stay open); SIGTERM ends the run in seconds - not
    after (max_retries + 1) x request_timeout_s = 5 x 300 s - with the finished steps checkpointed, exit 75."""
    run, marker = tmp_path / "run", tmp_path / "hung"
    job = Run(
        tmp_path / "log.txt",
        "--config",
        str(DEFAULT),
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        *COMMON,
        "rollout.engine=sglang",
        f"train.staleness={staleness}",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
        "rollout.sglang.request_timeout_s=300",
        f"rollout.sglang.extra_args=[--fault-hang-after, '72', --fault-marker, '{marker}']",
    )
    _wait_for(marker.is_file, job.proc)
    time.sleep(1.0)  # the trainer is now waiting on the hung request
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    rc, output = job.wait(120)
    elapsed = time.monotonic() - sent
    assert rc == 75, output[-3000:]
    assert elapsed < 20, f"took {elapsed:.1f}s to honour SIGTERM"
    assert "received SIGTERM" in output and "engine lost" not in output, output[-3000:]
    finished = len(_trained(run))
    assert finished >= 1, output[-3000:]
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == [f"step_{finished:06d}"]


def test_kill_9_takes_the_managed_rollout_server_with_the_trainer(tmp_path, warm_cache):
    """A managed SGLang server runs in a session of its own (stop() takes its process group); when the trainer
    is killed without stopping it, the kernel's parent-death signal ends it."""
    import psutil

    run = tmp_path / "run"
    job = Run(
        tmp_path / "log.txt",
        "--config",
        str(DEFAULT),
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        *COMMON,
        "rollout.engine=sglang",
        f"rollout.sglang.server_module={TEST_SERVER}",
        f"rollout.sglang.port={server_port()}",
    )
    _wait_for(lambda: len(_trained(run)) >= 1, job.proc)
    children = psutil.Process(job.proc.pid).children(recursive=True)
    servers = [p for p in children if "sglang_server" in " ".join(p.cmdline())]
    assert servers, [p.cmdline() for p in children]
    job.proc.send_signal(signal.SIGKILL)
    job.wait(60)
    _, alive = psutil.wait_procs(children, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"outlived the killed trainer: {[' '.join(p.cmdline())[:120] for p in alive]}"


def test_a_stop_signal_while_starting_ends_the_run_with_a_message(tmp_path):
    """SIGTERM during the start-up (here: the warm start) is honoured at the next warm-start step, not after the
    warm start (schedulers' grace periods are 30-120 s): exit 75, one line naming the step, nothing trained or
    cached."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    job = Run(
        tmp_path / "log.txt",
        "--config",
        str(DEFAULT),
        f"train.output_dir={run}",
        f"warm_start.cache_dir={cache}",
        *COMMON,
        "warm_start.steps=2000",
    )  # its own: it must run
    _wait_for(lambda: "warm start step" in job.log.read_text(errors="replace"), job.proc)
    sent = time.time()
    job.proc.send_signal(signal.SIGTERM)
    rc, output = job.wait(300)
    assert rc == 75, output[-3000:]
    assert time.time() - sent < 20, f"{time.time() - sent:.0f} s from the signal to the exit"
    assert "received SIGTERM at warm-start step" in output and "/2000" in output, output[-3000:]
    assert "Traceback" not in output and "nothing was trained" in output, output[-3000:]
    assert _trained(run) == [] and not (run / "checkpoints").exists() and not list(cache.glob("warmstart-*"))
