"""The RL step side by side with TRL's GRPOTrainer: same model, prompts, sampling and KL, interleaved.

    pip install -e .[bench]     # trl==1.16.0 (pinned; a benchmark dependency only)
    python tools/bench_trl.py [--shapes tiny,135m] [--steps 6] [--rounds 2] [--max-new-tokens 32]
                              [--variant NAME=override,override ...] [--precision fp32,bf16]

Workload per step (both systems): 8 prompts x 4 samples x ``--max-new-tokens`` new tokens at temperature 1,
k3 KL to the reference in the loss with coefficient 0.04 (TRL's ``beta``; megatron-kl
``kl.estimator=k3, kl.placement=loss``), one optimizer step per batch (TRL's default; ``algo.minibatches=1``)
whose pi_old comes from the update's own forward (TRL skips that pass with one iteration;
``algo.old_logprobs=from_update``), on CPU in each ``--precision``: ``fp32``, or ``bf16`` mixed precision (TRL
``bf16=True``: bf16 autocast over float32 weights, generation with the weights cast to bf16; megatron-kl
``model.params_dtype=bfloat16``: bf16 weights and activations, float32 main weights and gradient sums in the
optimizer). The model is a random-init Llama saved once as an HF checkpoint that both load:

    tiny   hidden 128, 2 layers, 4 heads (head_dim 32), FFN 256, vocabulary 49152, tied   (TRL's tiny test shape)
    135m   hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536, vocabulary 49152, tied   (SmolLM-135M's shape)

Prompts are 24 words of a 49152-word tokenizer built here (so both tokenize them identically); rewards are 0
for both (a random model solves nothing; TRL gets a constant reward function, megatron-kl its math task),
so the work per step is the same. Each (system, shape) runs in a fresh child process; children alternate
system order per round. Per system: tokens/s (response tokens / step time; median over the steps after the
first), the step split (generation / scoring = reference + old log-probs + rewards / update), peak RSS
(VmHWM at the end of the last training step, before any final evaluation or checkpoint), and each megatron-kl
variant's ratio to TRL. Variants: ``megatron-kl`` (the settings above), ``megatron-kl+tokens456``
(``train.micro_batch_tokens=456``: the 32 x 57-token batch in 4 microbatches, activation memory a quarter) and
``megatron-kl+recompute`` (``model.recompute=full``: activation recomputation); ``--variant`` replaces them.
Each precision is its own table, every system in it run in that precision, ratios to TRL in the same precision.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152
PROMPTS, SAMPLES, PROMPT_WORDS, BETA = 8, 4, 24, 0.04
SHAPES = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=256,
    ),
    "135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
    ),
}


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ------------------------------------------------------------------------------------------ workload


def build_workload(work: Path, shapes: list[str]) -> None:
    """Tokenizer, prompts and one random-init HF checkpoint per shape under ``work``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(work / "tokenizer")
    rng = random.Random(0)
    for split, count in (("train", 64), ("eval", 4)):
        with open(work / f"{split}.jsonl", "w") as handle:
            for _ in range(count):
                words = " ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(PROMPT_WORDS))
                handle.write(json.dumps({"problem": words, "answer": "7"}) + "\n")
    for shape in shapes:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=1,
            pad_token_id=0,
            **SHAPES[shape],
        )
        LlamaForCausalLM(config).save_pretrained(work / f"model-{shape}")


# ------------------------------------------------------------------------------------------ children


def run_trl(work: Path, shape: str, steps: int, new_tokens: int, precision: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["problem"]}]} for r in rows])
    records, current = [], {}

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            current["generation"] = current.get("generation", 0.0) + time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            current["generate_and_score"] = current.get("generate_and_score", 0.0) + time.perf_counter() - start
            current["tokens"] = int(out["completion_mask"].sum())
            return out

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - current["start"]
            records.append(
                {
                    "step": step,
                    "generation": current["generation"],
                    "scoring": current["generate_and_score"] - current["generation"],
                    "update": step - current["generate_and_score"],
                    "tokens": current["tokens"],
                }
            )

    config = GRPOConfig(
        output_dir=str(work / f"trl-{shape}"),
        per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=new_tokens,
        beta=BETA,
        learning_rate=1e-6,
        max_steps=steps,
        num_iterations=1,
        temperature=1.0,
        use_cpu=True,
        bf16=precision == "bf16",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        seed=1,
        disable_tqdm=True,
    )
    trainer = Timed(
        model=str(work / f"model-{shape}"),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(work / "tokenizer"),
        callbacks=[StepTimes()],
    )
    trainer.train()
    return {"records": records, "peak_rss_gib": peak_rss_gib()}


def megatron_kl_config(work: Path, shape: str, new_tokens: int) -> tuple[Path, list[str]]:
    """(YAML path, overrides) of the megatron-kl side of the workload under ``work`` (also tools/bench_step.py's
    ``--trl-workload``): the CPU job's settings without its model section (the structure comes from the
    checkpoint's config.json)."""
    import yaml

    base = yaml.safe_load((ROOT / "configs" / "cpu" / "default.yaml").read_text())
    base["model"] = {"max_position_embeddings": 256}
    config = work / "megatron-kl.yaml"
    config.write_text(yaml.safe_dump(base))
    return config, [
        f"init.hf_checkpoint={work / f'model-{shape}'}",
        "warm_start.enabled=false",
        "task.name=math",
        f"task.math.train_files=[{work / 'train.jsonl'}]",
        f"task.math.eval_files=[{work / 'eval.jsonl'}]",
        f"task.math.tokenizer={work / 'tokenizer'}",
        "task.math.instruction=",
        f"rollout.sampling.max_new_tokens={new_tokens}",
        "rollout.sampling.temperature=1.0",
        f"train.prompts_per_step={PROMPTS}",
        f"train.group_size={SAMPLES}",
        "algo.minibatches=1",
        "algo.ppo_epochs=1",
        "algo.old_logprobs=from_update",
        "kl.estimator=k3",
        "kl.placement=loss",
        "kl.level=token",
        f"kl.coef={BETA}",
        "kl.target=token_forward",
        "optim.lr=1.0e-6",
        "eval.interval=0",
        "eval.k=1",
        "checkpoint.interval=0",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]


def run_megatron_kl(work: Path, shape: str, steps: int, new_tokens: int, extra: list[str]) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(ROOT))
    from megatron_kl.models import parallel
    from megatron_kl.train import loop, trainer
    from megatron_kl.train.cli import single_process_env
    from megatron_kl.train.config import load_train_config
    from megatron_kl.train.metrics import read_metrics

    peak = {}
    save = trainer.Trainer.save

    def record_then_save(self):  # the final checkpoint follows the last step: peak RSS first
        peak.setdefault("gib", peak_rss_gib())
        return save(self)

    trainer.Trainer.save = record_then_save
    out = work / f"mk-{shape}-{time.time_ns()}"
    config, overrides = megatron_kl_config(work, shape, new_tokens)
    cfg = load_train_config(str(config), [*overrides, f"train.steps={steps}", f"train.output_dir={out}", *extra])
    single_process_env()
    try:
        loop.train(cfg)
    finally:
        parallel.destroy()
    records = []
    metrics = read_metrics(out / "metrics.jsonl")
    shutil.rmtree(out, ignore_errors=True)  # its final checkpoint (2.3 GB at 135M): many children fill a disk
    for r in metrics:
        if "time/step" not in r:
            continue
        step = r["time/step"] - r.get("time/eval", 0.0)
        records.append(
            {
                "step": step,
                "generation": r["time/rollout_wait"],
                "scoring": r["time/reference"] + r["time/old_logprobs"],
                "update": r["time/update"],
                "tokens": int(r["throughput/response_tokens"]),
            }
        )
    return {"records": records, "peak_rss_gib": peak.get("gib", peak_rss_gib())}


# ------------------------------------------------------------------------------------------ parent


PARAMS_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def child(system: str, work: Path, shape: str, steps: int, new_tokens: int, precision: str, extra: list[str]) -> dict:
    if system != "trl":
        extra = [f"model.params_dtype={PARAMS_DTYPE[precision]}", *extra]
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "trl" if system == "trl" else "megatron-kl",
        "--work",
        str(work),
        "--shapes",
        shape,
        "--steps",
        str(steps),
        "--max-new-tokens",
        str(new_tokens),
        "--precision",
        precision,
        *(f"--override={o}" for o in extra),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{system} {shape} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    measured = [r for run in runs for r in run["records"][1:]]  # the first step of each child is warm-up
    median = {k: statistics.median(r[k] for r in measured) for k in ("step", "generation", "scoring", "update")}
    rates = [r["tokens"] / r["step"] for r in measured]
    return {
        **median,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_max": max(rates),
        "peak_rss_gib": max(run["peak_rss_gib"] for run in runs),
        "steps": len(measured),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,135m")
    parser.add_argument("--steps", type=int, default=6, help="steps per child (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--variant", action="append", default=None, help="a megatron-kl variant NAME=override,override (repeatable)"
    )
    parser.add_argument(
        "--precision", default="fp32", help=f"comma-separated, of {sorted(PARAMS_DTYPE)}: one table each (default fp32)"
    )
    parser.add_argument("--child", choices=["trl", "megatron-kl"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    if args.child:
        if args.child == "trl":
            result = run_trl(Path(args.work), shapes[0], args.steps, args.max_new_tokens, args.precision)
        else:
            result = run_megatron_kl(Path(args.work), shapes[0], args.steps, args.max_new_tokens, args.override)
        print(json.dumps(result))
        return 0
    variants = {
        "megatron-kl": [],
        "megatron-kl+tokens456": ["train.micro_batch_tokens=456"],
        "megatron-kl+recompute": ["model.recompute=full"],
    }
    if args.variant:
        variants = {}
        for spec in args.variant:
            name, _, overrides = spec.partition("=")
            variants[name] = [o for o in overrides.split(",") if o]
    systems = ["trl", *variants]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"--shapes: unknown {sorted(unknown)}; use {sorted(SHAPES)}")
    precisions = args.precision.split(",")
    if set(precisions) - set(PARAMS_DTYPE):
        parser.error(f"--precision: unknown {sorted(set(precisions) - set(PARAMS_DTYPE))}; use {sorted(PARAMS_DTYPE)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_workload(work, shapes)
        results = {(p, s, system): [] for p in precisions for s in shapes for system in systems}
        for round_index in range(args.rounds):
            order = systems if round_index % 2 == 0 else systems[::-1]
            for shape in shapes:
                for precision in precisions:
                    for system in order:
                        results[(precision, shape, system)].append(
                            child(
                                system,
                                work,
                                shape,
                                args.steps,
                                args.max_new_tokens,
                                precision,
                                variants.get(system, []),
                            )
                        )
    print(
        f"{PROMPTS} prompts x {SAMPLES} samples x {args.max_new_tokens} new tokens per step, k3 KL in the loss "
        f"(coef {BETA}), 1 optimizer step per batch, {os.cpu_count()} CPU cores; {args.rounds} interleaved "
        f"rounds x {args.steps} steps per child (first step of each child excluded); medians"
    )
    for precision in precisions:
        print(f"\n{precision}:")
        table(
            shapes,
            systems,
            variants,
            {(s, system): results[(precision, s, system)] for s in shapes for system in systems},
        )
    return 0


def table(shapes: list[str], systems: list[str], variants: dict, results: dict) -> None:
    header = (
        f"{'shape':<6}{'system':<23}{'tokens/s':>9}{'(max)':>8}{'step s':>8}{'gen s':>8}{'score s':>8}"
        f"{'update s':>9}{'peak RSS GiB':>13}"
    )
    print(header)
    for shape in shapes:
        summary = {system: summarize(results[(shape, system)]) for system in systems}
        for system, s in summary.items():
            print(
                f"{shape:<6}{system:<23}{s['tokens_per_s']:>9.1f}{s['tokens_per_s_max']:>8.1f}{s['step']:>8.2f}"
                f"{s['generation']:>8.2f}{s['scoring']:>8.2f}{s['update']:>9.2f}{s['peak_rss_gib']:>13.2f}"
            )
        trl = summary["trl"]
        for name in variants:
            mk = summary[name]
            print(
                f"{shape:<6}{'ratio ' + name:<23}{mk['tokens_per_s'] / trl['tokens_per_s']:>8.2f}x{'':>8}"
                f"{mk['step'] / trl['step']:>7.2f}x{mk['generation'] / trl['generation']:>7.2f}x"
                f"{mk['scoring'] / trl['scoring']:>7.2f}x{mk['update'] / trl['update']:>8.2f}x"
                f"{mk['peak_rss_gib'] / trl['peak_rss_gib']:>12.2f}x   (/ TRL)"
            )


if __name__ == "__main__":
    sys.exit(main())
