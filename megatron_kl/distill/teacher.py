"""The frozen teacher of on-policy distillation: its architecture, its weights, and its scoring pass.

The teacher is a Megatron GPTModel like the reference (no gradients, eval mode, optionally offloaded to host memory
between passes), of its own architecture and size. Its pass over the student's sampled sequences yields the teacher's
log-probs at the sampled tokens (the k1 / k2 / k3 terms read them) and, when the exact KL is needed, its final hidden
states: the student's passes then form the teacher's vocab-sharded logits chunk by chunk through :attr:`Teacher.head`
(the reference head's mechanism), so no full-vocabulary teacher logits tensor is ever held on the fused path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_kl.config import ConfigError, ModelConfig
from megatron_kl.distill.config import DistillConfig, TeacherConfig, teacher_parallel
from megatron_kl.distill.layout import (
    ResharedHead,
    build_in_own_layout,
    expert_groups,
    reshard_output_weight,
    score_in_own_layout,
)
from megatron_kl.distill.served import ServedTeacher
from megatron_kl.models import builder, hf, output_head, parallel, pipeline, state
from megatron_kl.models.offload import ReferenceOffload
from megatron_kl.vocab_parallel.candidates import top_k_logprobs

log = logging.getLogger(__name__)

# files whose bytes define an HF tokenizer's vocabulary (the first present is compared)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
TOP_K_CHUNK_ELEMENTS = 1 << 24  # teacher logits formed at a time for its top-k (64 MiB in float32)


def teacher_model(teacher: TeacherConfig) -> Optional[ModelConfig]:
    """The teacher's architecture: its HF directory's config.json (``source=hf``; ``source=server`` with the served
    directory given), None for a server without it, else ``distill.teacher.model``."""
    if teacher.source == "server" and teacher.hf_checkpoint is None:
        return None
    if teacher.source not in ("hf", "server"):
        return teacher.model
    try:
        checkpoint = hf.HFCheckpoint(teacher.hf_checkpoint)
        checkpoint.check_shapes()
    except (hf.HFCheckpointError, FileNotFoundError) as err:
        raise ConfigError(f"distill.teacher.hf_checkpoint={teacher.hf_checkpoint}: {err}") from None
    return checkpoint.model_config()


def _tokenizer_digest(directory) -> Optional[tuple[str, str]]:
    for name in TOKENIZER_FILES:
        path = Path(directory) / name
        if path.is_file():
            return name, hashlib.sha256(path.read_bytes()).hexdigest()
    return None


def check_vocabulary(
    student: ModelConfig, teacher: ModelConfig, student_dir: Optional[str], teacher_dir: Optional[str]
) -> None:
    """The teacher scores the student's token ids: the same vocabulary size, and (both being HF directories with
    a tokenizer) the same tokenizer bytes. A mismatch is refused naming both."""
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError(
            f"distill.teacher has vocabulary size {teacher.vocab_size}, the student (model.vocab_size) "
            f"{student.vocab_size}: the teacher must score the student's token ids; use a teacher of "
            "the student's tokenizer"
        )
    if student_dir is None or teacher_dir is None:
        return
    mine, theirs = _tokenizer_digest(student_dir), _tokenizer_digest(teacher_dir)
    if mine is not None and theirs is not None and mine != theirs:
        raise ConfigError(
            f"distill.teacher.hf_checkpoint={teacher_dir} has another tokenizer than the student's "
            f"init.hf_checkpoint={student_dir} ({theirs[0]} {theirs[1][:12]} vs {mine[0]} "
            f"{mine[1][:12]}): the same ids would mean different tokens; use a teacher of the student's "
            "tokenizer family"
        )


def own_layout_of(cfg) -> bool:
    """Whether the teacher runs in a tensor-parallel layout of its own (distill/layout.py) rather than the student's."""
    return teacher_parallel(cfg.distill.teacher, cfg.parallel) is not cfg.parallel


def check_teacher(cfg, world_size: Optional[int] = None) -> ModelConfig:
    """What ``--check`` and every start decide about the teacher from the configuration alone: its architecture,
    its vocabulary against the student's, its layout against the world. Returns the teacher's ModelConfig."""
    distill: DistillConfig = cfg.distill
    model = teacher_model(distill.teacher)
    if distill.teacher.source == "server":  # no weights here: the vocabulary, when the served directory is given
        if model is not None:
            check_vocabulary(cfg.model, model, cfg.init.hf_checkpoint, distill.teacher.hf_checkpoint)
        return model
    check_vocabulary(cfg.model, model, cfg.init.hf_checkpoint, distill.teacher.hf_checkpoint)
    layout = teacher_parallel(distill.teacher, cfg.parallel)
    if layout is not cfg.parallel:
        where = (
            f"distill.teacher.tensor_parallel={distill.teacher.tensor_parallel} / pipeline_parallel="
            f"{distill.teacher.pipeline_parallel}"
        )
        size = layout.tensor_parallel * layout.pipeline_parallel
        if world_size is not None and world_size % size:
            raise ConfigError(
                f"{where}: the teacher's tensor_parallel x pipeline_parallel = {size} does not divide "
                f"the {world_size} ranks; pick sizes whose product divides them"
            )
    if model.num_layers % layout.pipeline_parallel:
        raise ConfigError(
            f"distill.teacher: {model.num_layers} layers do not split over pipeline_parallel="
            f"{layout.pipeline_parallel} stages"
        )
    if model.num_attention_heads % layout.tensor_parallel or model.num_query_groups % layout.tensor_parallel:
        raise ConfigError(
            f"distill.teacher: {model.num_attention_heads} attention heads / {model.num_query_groups} "
            f"query groups do not split over tensor_parallel={layout.tensor_parallel}"
        )
    return model


def describe_teacher(cfg) -> str:
    """One line on the teacher a configuration asks for: architecture, size, layout and where its weights come from."""
    teacher = cfg.distill.teacher
    model = teacher_model(teacher)
    if teacher.source == "server":
        served = f" (serving {teacher.hf_checkpoint})" if teacher.hf_checkpoint else ""
        return (
            f"served by {', '.join(teacher.server.urls)}{served}: its log-probs at the sampled tokens and its "
            f"top-{cfg.distill.kl.top_k} per position over HTTP"
        )
    layout = teacher_parallel(teacher, cfg.parallel)
    where = {
        "hf": teacher.hf_checkpoint,
        "checkpoint": teacher.checkpoint,
        "warm_start": f"its warm start ({teacher.warm_start_steps} supervised steps, seed {teacher.warm_start_seed})",
    }[teacher.source]
    place = (
        "in the student's layout"
        if layout is cfg.parallel
        else f"at tensor_parallel={layout.tensor_parallel}, pipeline_parallel={layout.pipeline_parallel} in its own "
        "layout"
    )
    return f"{model.architecture}, {model.num_layers} layers, hidden {model.hidden_size}, {place}, weights from {where}"


def _teacher_warm_start_config(cfg, model: ModelConfig):
    """The student's configuration with the teacher's architecture and warm-start recipe: its key names the shipped
    or cached teacher (megatron_kl.train.warmstart)."""
    teacher = cfg.distill.teacher
    warm_start = dataclasses.replace(
        cfg.warm_start,
        enabled=True,
        checkpoint=None,
        steps=teacher.warm_start_steps,
        seed=teacher.warm_start_seed,
        source="auto" if cfg.warm_start.source == "train" else cfg.warm_start.source,
    )
    return cfg.with_sections(model=model, warm_start=warm_start)


def load_state_file(path: Path, field: str) -> dict[str, torch.Tensor]:
    """A full-state file of tensors: safetensors, or a torch file read with ``weights_only`` (no general unpickler).
    Anything else, or a file that is not a flat mapping of names to tensors, is an error naming ``field``."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            data = load_file(str(path))
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file: say which and why
        raise ConfigError(
            f"{field}={path} cannot be read as a state of tensors ({type(err).__name__}: {err}); give "
            "a .safetensors file or a torch file of tensors (torch.save(state_dict))"
        ) from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise ConfigError(f"{field}={path} is not a mapping of tensor names to tensors")
    return data


def _full_state(cfg, model: ModelConfig, task, should_stop, warm_start: Callable) -> dict:
    teacher = cfg.distill.teacher
    if teacher.source == "checkpoint":
        return load_state_file(Path(teacher.checkpoint), "distill.teacher.checkpoint")
    state_dict = warm_start(_teacher_warm_start_config(cfg, model), task, should_stop)
    if state_dict is None:  # pragma: no cover - enabled is forced on above
        raise ConfigError("distill.teacher.source=warm_start produced no weights")
    return state_dict


@dataclasses.dataclass
class Teacher:
    """The frozen teacher's chunks in this rank's layout, its output head (turning stored hidden states into its
    vocab-sharded logits in the student's partition) and its host offload; ``own``: its own tensor-parallel layout
    (distill/layout.py), with this rank's student data-parallel rank and size, or None (the student's layout)."""

    chunks: list
    model: ModelConfig
    offload: ReferenceOffload
    own: Optional[object] = None  # models.parallel.OwnLayout
    resharded_head: Optional[object] = None  # distill.layout.ResharedHead (own layout)
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def head(self):
        return self.resharded_head if self.resharded_head is not None else output_head.ReferenceHead(self.chunks)

    def score(
        self,
        sequences: pipeline.SequenceBatch,
        microbatches: int,
        vocab: pipeline.VocabOptions,
        capture_hidden: bool,
        token_budget: int = 0,
    ) -> pipeline.TokenStats:
        """The teacher's per-token log-probs (and entropy) of ``sequences`` under its full softmax(z / T), never
        truncated (every KL is to the full distribution: docs/kl-math.md), and with ``capture_hidden`` its final
        hidden states for the exact KL. The caller holds the weights resident (``offload.resident()``)."""
        full = dataclasses.replace(vocab, truncation=None)
        sequences = dataclasses.replace(sequences, routed_experts=None)  # the teacher routes itself (its own experts)
        if self.own is not None:
            return score_in_own_layout(
                self.chunks,
                self.own,
                sequences,
                microbatches,
                full,
                capture_hidden,
                token_budget,
                self.dp_rank,
                self.dp_size,
            )
        return pipeline.compute_token_stats(
            self.chunks, sequences, microbatches, full, capture_hidden=capture_hidden, token_budget=token_budget
        )

    @torch.no_grad()
    def top_k(
        self,
        hidden: Optional[torch.Tensor],
        k: int,
        vocab: pipeline.VocabOptions,
        tp_group,
        token_budget: int = TOP_K_CHUNK_ELEMENTS,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The teacher's ``k`` most likely tokens at every target position of its pass's ``hidden [B, S, H]``: (ids
        [B, S-1, k] int64, log-probs [B, S-1, k] float32) under its full softmax(z / T), formed through :attr:`head`
        in the student's vocabulary partition (``tp_group``: the student's TP group, collective over it) a few rows
        at a time (about ``token_budget`` logits each). (None, None) where the pass kept no hidden states (off the
        last pipeline stage)."""
        if hidden is None:
            return None, None
        rows, width = hidden.shape[0], hidden.shape[1]
        head = self.head
        ids = torch.zeros(rows, width - 1, k, dtype=torch.long)
        logprobs = torch.zeros(rows, width - 1, k, dtype=torch.float32)
        local_vocab = head.weight().shape[0]
        step = max(1, token_budget // max(1, width * local_vocab))
        for lo in range(0, rows, step):
            part = slice(lo, min(rows, lo + step))
            logits = head.logits(hidden[part].to(head.weight().device))[:, : width - 1]
            top_ids, top_logprobs = top_k_logprobs(logits, k, tp_group, vocab.temperature, vocab.vocab_size)
            ids[part], logprobs[part] = top_ids.cpu(), top_logprobs.float().cpu()
        return ids, logprobs


def build_teacher(
    cfg, task, topology, warm_start: Callable, should_stop: Optional[Callable] = None
) -> Teacher | ServedTeacher:
    """The teacher of ``cfg.distill`` in its layout (the student's, or its own tensor-parallel one), weights loaded
    and frozen (collective: every rank). ``warm_start(cfg, task, should_stop)``: the trainer's warm-start function
    (megatron_kl.train.warmstart.warm_start_state), for ``source=warm_start``."""
    model = check_teacher(cfg, dist.get_world_size())
    if cfg.distill.teacher.source == "server":
        log.info("teacher: %s; objective %s, coef %g", describe_teacher(cfg), cfg.distill.kl.name, cfg.distill.kl.coef)
        top_k = cfg.distill.kl.top_k if cfg.distill.kl.estimator == "topk" else 0  # sampled estimators: no top-k
        return ServedTeacher(cfg.distill.teacher.server, cfg.model.vocab_size, top_k, topology)
    layout = teacher_parallel(cfg.distill.teacher, cfg.parallel)
    own = experts = None  # experts: the routed experts' groups in a layout of its own (default: megatron's)
    if layout is cfg.parallel:
        chunks = builder.freeze(builder.build_model_chunks(model, layout))
        tp_group = topology.tp_group
    else:
        own, chunks = build_in_own_layout(model, layout, cfg.parallel.distributed_timeout_s)
        tp_group = own.tp
        experts = expert_groups(own)
    tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    teacher = cfg.distill.teacher
    if teacher.source == "hf":
        hf.load_hf_into(chunks, hf.HFCheckpoint(teacher.hf_checkpoint), model, tp_group, experts)
        where = teacher.hf_checkpoint
    else:
        full = _full_state(cfg, model, task, should_stop, warm_start)
        try:
            state.load_full_state_dict(chunks, full, model.tie_word_embeddings, tp_rank, tp_size, experts)
        except (KeyError, ValueError) as err:
            raise ConfigError(
                f"distill.teacher ({teacher.source}): its weights do not fit distill.teacher.model "
                f"({err}); give the architecture the weights were trained with"
            ) from None
        where = teacher.checkpoint or f"its warm start ({teacher.warm_start_steps} supervised steps)"
    parallel.reseed(cfg.train.seed)  # the RL phase draws the same numbers whether the teacher was cached or trained
    params = sum(p.numel() for c in chunks for p in c.parameters()) * tp_size
    log.info(
        "teacher: %s, %d layers, hidden %d (~%.2fM parameters) from %s, TP %d%s; objective %s, coef %g",
        model.architecture,
        model.num_layers,
        model.hidden_size,
        params / 1e6,
        where,
        tp_size,
        " (its own layout)" if own is not None else " (the student's layout)",
        cfg.distill.kl.name,
        cfg.distill.kl.coef,
    )
    head = None
    if own is not None:
        head = ResharedHead(
            reshard_output_weight(
                chunks[0],
                own,
                model.vocab_size,
                cfg.model.padded_vocab_size(cfg.parallel.tensor_parallel),
                topology.tp_group,
            )
        )
    return Teacher(
        chunks, model, ReferenceOffload(chunks, teacher.offload), own, head, topology.dp_rank, topology.dp_size
    )
