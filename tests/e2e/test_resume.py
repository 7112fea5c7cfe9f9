"""Resuming end to end on CPU: a run killed with SIGKILL and resumed logs what the uninterrupted run logs, damaged
checkpoints are passed over naming the damage, bf16 mixed precision resumes exactly."""

from __future__ import annotations

import os
import signal
import time

import psutil

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.metrics import read_metrics
from tests.e2e.runs import DEFAULT, Run, short_config, stable
from tests.e2e.workers import train_worker


def test_kill_9_and_resume_reproduce_the_uninterrupted_run(tmp_path, warm_cache):
    common = [
        f"warm_start.cache_dir={warm_cache}",
        "train.steps=12",
        "checkpoint.interval=4",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=4",
        "logging.progress=false",
        "train.staleness=1",
    ]
    code, output = Run(
        tmp_path / "full.log", "--config", str(DEFAULT), f"train.output_dir={tmp_path / 'full'}", *common
    ).wait()
    assert code == 0, output[-3000:]

    run = tmp_path / "killed"
    killed = Run(tmp_path / "killed.log", "--config", str(DEFAULT), f"train.output_dir={run}", *common)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_000004").is_dir():
        assert killed.proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.01)
    helpers = psutil.Process(killed.proc.pid).children(recursive=True)
    assert helpers, "no checkpoint helper was forked: the orphan check below is void"
    killed.proc.send_signal(signal.SIGKILL)
    assert killed.wait()[0] == -signal.SIGKILL
    assert not (run / "checkpoints" / "step_000012").exists(), "the run finished before the kill: test is void"
    _, alive = psutil.wait_procs(helpers, timeout=10)  # forked helpers die with the trainer (child_processes)
    assert not alive, f"helpers outlived the killed trainer: {[(p.pid, p.name()) for p in alive]}"

    code, output = Run(tmp_path / "resumed.log", "--config", str(DEFAULT), f"train.output_dir={run}", *common).wait()
    assert code == 0, output[-3000:]
    assert "resumed from" in output
    expected, got = (
        stable(read_metrics(tmp_path / "full" / "metrics.jsonl")),
        stable(read_metrics(run / "metrics.jsonl")),
    )
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    assert got == expected  # exact: same rollouts, same updates, same optimizer state
    # two counters: 12 RL steps of ppo_epochs x minibatches = 1 x 2 optimizer steps (the resumed run's too)
    steps = [r for r in got if "optim/steps" in r]
    assert [r["optim/steps"] for r in steps] == [2.0 * (r["step"] + 1) for r in steps] and steps[-1]["step"] == 11


def test_resume_falls_back_past_damaged_checkpoints(tmp_path, warm_cache):
    """Each restart meets a damaged newest checkpoint - no trainer.pt (plus stray step_* directories and a
    partial metrics line), a truncated .distcp shard, an empty rank file, a pickle that would run code -
    reports it naming the file, resumes from the previous complete one and ends with every step logged once."""
    run = tmp_path / "run"
    common = [
        "--config",
        str(DEFAULT),
        f"train.output_dir={run}",
        f"warm_start.cache_dir={warm_cache}",
        "checkpoint.interval=1",
        "checkpoint.keep=3",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "task.eval_size=8",
        "eval.k=2",
        "eval.interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.staleness=1",
    ]
    code, output = Run(tmp_path / "base.log", *common, "train.steps=2").wait()
    assert code == 0, output[-3000:]
    ckpts = run / "checkpoints"
    pwned = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    def no_trainer_file(path):
        (path / "trainer.pt").unlink()
        (ckpts / "step_abc").mkdir()
        (ckpts / "step_000099").mkdir()  # no completion marker
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"step": 1, "loss/to')

    def truncated_shard(path):
        shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    def empty_rank_file(path):
        (path / "rank_00000.pt").write_bytes(b"")

    def pickle_payload(path):
        import pickle

        (path / "trainer.pt").write_bytes(pickle.dumps(Payload()))

    damages = [
        (no_trainer_file, "trainer.pt is missing"),
        (truncated_shard, "bytes, the manifest says"),
        (empty_rank_file, "rank_00000.pt has 0 bytes"),
        (pickle_payload, "trainer.pt"),
    ]
    for steps, (damage, message) in enumerate(damages, start=3):
        newest = ckpts / f"step_{steps - 1:06d}"
        damage(newest)
        code, output = Run(tmp_path / f"resume{steps}.log", *common, f"train.steps={steps}").wait()
        assert code == 0, (damage.__name__, output[-3000:])
        assert message in output and "trying the previous checkpoint" in output, (damage.__name__, output[-3000:])
        assert f"resumed from {ckpts / f'step_{steps - 2:06d}'}" in output, damage.__name__
    assert not pwned.exists(), "a pickle in a checkpoint was executed"
    steps_logged = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss/total" in r]
    assert steps_logged == list(range(len(damages) + 2))


def test_checkpoint_keep_below_one_is_a_config_error(tmp_path, warm_cache):
    code, output = Run(
        tmp_path / "keep.log", "--config", str(DEFAULT), f"train.output_dir={tmp_path / 'o'}", "checkpoint.keep=-1"
    ).wait()
    assert code == 2 and "checkpoint.keep=-1 must be >= 1" in output


def test_bf16_mixed_precision_trains_and_resumes_exactly(tmp_path, warm_cache):
    """model.params_dtype=bfloat16 on the CPU job (bf16 weights, activations and rollout engine; float32 main
    weights and Adam state in megatron's mixed-precision optimizer): every metric finite, the policy moves, and
    a run stopped at its step-1 checkpoint and resumed logs exactly the uninterrupted run's step 1 - the
    checkpoint restores the float32 main weights, not only their bf16 copies."""
    common = [
        "model.params_dtype=bfloat16",
        "checkpoint.interval=1",
        "rollout.sampling.temperature=1.0",
        "train.prompts_per_step=4",
        "train.steps=2",
    ]
    full = run_ranks(train_worker, 1, short_config(tmp_path / "full", warm_cache, *common), timeout_s=300)[0]["metrics"]
    steps = [r for r in full if "loss/total" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:
        for key in (
            "loss/total",
            "kl/exact_token",
            "kl/k3_token",
            "entropy/mean",
            "optim/grad_norm",
            "mismatch/abs_logprob_mean",
        ):
            assert record.get(key) is not None, f"{key} missing or not finite in step {record['step']}"
    assert steps[-1]["kl/exact_token"] > 0 and steps[-1]["optim/grad_norm"] > 0
    # engine and trainer hold the same bf16 weights: their log-probs of the sampled tokens agree to bf16 rounding
    assert all(r["mismatch/abs_logprob_mean"] < 1e-2 for r in steps)

    stopped = tmp_path / "stopped"
    run_ranks(train_worker, 1, short_config(stopped, warm_cache, *common, "train.steps=1"), timeout_s=300)
    resumed = run_ranks(train_worker, 1, short_config(stopped, warm_cache, *common), timeout_s=300)[0]["metrics"]
    assert [r["step"] for r in resumed if "loss/total" in r] == [0, 1]
    assert stable(resumed) == stable(full)
