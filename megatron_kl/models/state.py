"""Full (unsharded) state <-> this rank's TP/PP shards of a GPTModel.

The full layout is the TP=1, PP=1 GPTModel state dict with global layer indices and the vocabulary
trimmed to the true ``vocab_size`` rows, so it does not depend on the parallel layout. It is what the
layout-equivalence tests compare, and what HF conversion maps to and from.

Sharding rules come from the attributes megatron-core sets on each parameter
(``tensor_model_parallel``, ``partition_dim``); the one layout subtlety is the SwiGLU ``linear_fc1``
whose local shard is ``[gate_r; up_r]``, not a contiguous slice of ``[gate; up]``.

Mixture-of-experts layers: an expert-parallel rank holds experts ``[r E/EP, (r+1) E/EP)`` as
``mlp.experts.local_experts.0..E/EP-1``; the full layout names them by their global index, and their matrices
are split over the expert-tensor-parallel group (``ExpertGroups``) instead of the TP group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_kl.models.parallel import collective_device
from megatron_kl.vocab_parallel.groups import group_size_rank

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EXPERT_NAME = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups of routed experts: ``ep`` splits the experts, ``etp`` each expert's matrices
    (None: one rank). ``from_megatron()``: megatron-core's groups of this process."""

    ep: object = None
    etp: object = None

    @staticmethod
    def from_megatron() -> "ExpertGroups":
        from megatron.core import parallel_state

        return ExpertGroups(
            ep=parallel_state.get_expert_model_parallel_group(), etp=parallel_state.get_expert_tensor_parallel_group()
        )

    def ep_size_rank(self) -> tuple[int, int]:
        return group_size_rank(self.ep)

    def etp_size_rank(self) -> tuple[int, int]:
        return group_size_rank(self.etp)


def is_expert(name: str) -> bool:
    return EXPERT_NAME.search(name) is not None


def local_experts_per_layer(chunks: list) -> int:
    """Routed experts per layer on this rank (0: a dense model)."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is not None:
                return experts.num_local_experts
    return 0


def _expert_groups(chunks: list, experts: Optional[ExpertGroups]) -> Optional[ExpertGroups]:
    """The expert groups for a model with routed experts (megatron's when not given); None for a dense one."""
    if not local_experts_per_layer(chunks):
        return None
    return experts if experts is not None else ExpertGroups.from_megatron()


def shift_expert_index(name: str, offset: int) -> str:
    """``name`` with its local expert index j replaced by ``offset + j`` (the global index of expert j on the
    expert-parallel rank whose first expert is ``offset``); other names unchanged."""
    match = EXPERT_NAME.search(name)
    if match is None or not offset:
        return name
    return EXPERT_NAME.sub(f".mlp.experts.local_experts.{offset + int(match.group(1))}.", name, count=1)


def _is_glu_fc1(name: str) -> bool:
    """A SwiGLU input projection [gate; up]: the dense MLP's, a routed expert's or the shared expert's."""
    return ".mlp." in name and (name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"))


def _named_params_global(chunks: list, tied: bool, expert_offset: int = 0):
    """Yield (global_name, param) for every parameter of this rank's chunks (local expert j named
    ``expert_offset + j``)."""
    for chunk in chunks:
        layers = chunk.decoder.layers
        for name, param in chunk.named_parameters():
            if tied and name == "output_layer.weight":
                continue  # the embedding is the output weight; exported once
            match = _LAYER.match(name)
            if match:
                global_index = layers[int(match.group(1))].layer_number - 1
                name = f"decoder.layers.{global_index}." + name[match.end() :]
            yield shift_expert_index(name, expert_offset), param


def shard_tensor(full: torch.Tensor, name: str, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full tensor for parameter ``param`` (megatron's TP layout)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if _is_glu_fc1(name):
        gate, up = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(gate, tp_size, dim)[tp_rank], torch.chunk(up, tp_size, dim)[tp_rank]], dim)
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]


def unshard_tensor(pieces: list[torch.Tensor], name: str, param: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` given every TP rank's piece in rank order."""
    if not getattr(param, "tensor_model_parallel", False) or len(pieces) == 1:
        return pieces[0]
    dim = param.partition_dim
    if _is_glu_fc1(name):
        halves = [torch.chunk(p, 2, dim=dim) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(pieces, dim=dim)


def _full_shape(name: str, param: torch.Tensor, tp_size: int, vocab_size: int) -> tuple:
    shape = list(param.shape)
    if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    if name in _VOCAB_PARAMS:
        shape[0] = vocab_size
    return tuple(shape)


def iter_full_state(
    chunks: list,
    vocab_size: int,
    tied: bool,
    tp_group=None,
    pp_group=None,
    getter: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    experts: Optional[ExpertGroups] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: yield ``(full-layout name, full tensor)`` one parameter at a time on every rank.

    Each tensor is all-gathered over TP by its pipeline stage and broadcast over PP from that stage, so
    at most one full tensor is alive per rank (streaming export of large models). Stages in order, so
    layers come in global order. ``getter`` picks what to gather (default the weights; e.g. main_grad).
    Routed experts (``experts``: their groups, megatron's by default) are gathered over the expert-TP group
    and each expert-parallel rank's experts broadcast over the EP group in turn, so every rank yields all.
    """
    getter = getter or (lambda p: p.data)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    pp_size = dist.get_world_size(pp_group) if pp_group is not None else 1
    pp_rank = dist.get_rank(pp_group) if pp_group is not None else 0
    experts = _expert_groups(chunks, experts)
    ep_size, ep_rank = experts.ep_size_rank() if experts is not None else (1, 0)
    etp_size = experts.etp_size_rank()[0] if experts is not None else tp_size
    local_experts = local_experts_per_layer(chunks)
    params = list(_named_params_global(chunks, tied))  # local expert indices: the same names on every EP rank
    for stage in range(pp_size):
        meta = [
            [
                (name, _full_shape(name, p, etp_size if is_expert(name) else tp_size, vocab_size), getter(p).dtype)
                for name, p in params
            ]
            if stage == pp_rank
            else None
        ]
        if pp_size > 1:
            dist.broadcast_object_list(meta, src=dist.get_global_rank(pp_group, stage), group=pp_group)
        for index, (name, shape, dtype) in enumerate(meta[0]):
            if stage == pp_rank:
                param = params[index][1]
                expert = is_expert(name)
                tensor = getter(param).detach().contiguous()
                group, size = (experts.etp, etp_size) if expert else (tp_group, tp_size)
                if size > 1 and getattr(param, "tensor_model_parallel", False):
                    pieces = [torch.empty_like(tensor) for _ in range(size)]
                    dist.all_gather(pieces, tensor, group=group)
                    tensor = unshard_tensor(pieces, name, param)
                if name in _VOCAB_PARAMS:
                    tensor = tensor[:vocab_size]
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype)
            if pp_size > 1:
                tensor = tensor.to(collective_device(pp_group))
                dist.broadcast(tensor, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            if not is_expert(name):
                yield name, tensor.cpu()
                continue
            for source in range(ep_size):  # expert-parallel rank ``source`` holds global expert source * E_local + j
                piece = tensor
                if ep_size > 1:
                    piece = tensor.clone() if source == ep_rank else torch.empty_like(tensor)
                    piece = piece.to(collective_device(experts.ep))
                    dist.broadcast(piece, src=dist.get_global_rank(experts.ep, source), group=experts.ep)
                yield shift_expert_index(name, source * local_experts), piece.cpu()


def full_state_dict(
    chunks: list,
    vocab_size: int,
    tied: bool,
    tp_group=None,
    pp_group=None,
    getter: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    experts: Optional[ExpertGroups] = None,
) -> dict[str, torch.Tensor]:
    """Gather the full state (or, with ``getter``, e.g. gradients) on every rank, on the CPU, fp32 kept.
    Holds everything at once: for tests and small models (stream with :func:`iter_full_state`)."""
    return dict(
        sorted(
            (name, t.clone())
            for name, t in iter_full_state(chunks, vocab_size, tied, tp_group, pp_group, getter, experts)
        )
    )


def load_full_state_dict(
    chunks: list,
    full: Mapping[str, torch.Tensor],
    tied: bool,
    tp_rank: int,
    tp_size: int,
    experts: Optional[ExpertGroups] = None,
) -> None:
    """Copy this rank's shards out of a full state into ``chunks`` (in place). ``full`` may be a lazy
    mapping (e.g. :class:`megatron_kl.models.hf.HFStateView`): each tensor is read once, sharded, copied.
    Routed experts: this expert-parallel rank's experts, sharded over the expert-TP group."""
    missing = []
    experts = _expert_groups(chunks, experts)
    ep_rank = experts.ep_size_rank()[1] if experts is not None else 0
    etp_size, etp_rank = experts.etp_size_rank() if experts is not None else (tp_size, tp_rank)
    for name, param in _named_params_global(chunks, tied, expert_offset=ep_rank * local_experts_per_layer(chunks)):
        if name not in full:
            missing.append(name)
            continue
        source = full[name]
        if name in _VOCAB_PARAMS:
            padded_rows = param.shape[0] * (tp_size if getattr(param, "tensor_model_parallel", False) else 1)
            pad = torch.zeros((padded_rows - source.shape[0],) + tuple(source.shape[1:]), dtype=source.dtype)
            source = torch.cat([source, pad], dim=0)
        if is_expert(name):
            piece = shard_tensor(source, name, param, etp_rank, etp_size)
        else:
            piece = shard_tensor(source, name, param, tp_rank, tp_size)
        if piece.shape != param.shape:
            raise ValueError(f"state tensor {name}: shard shape {tuple(piece.shape)} != parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(piece.to(param.dtype))
    if missing:
        raise KeyError(f"full state dict lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    if tied:
        _copy_embedding_to_output_layer(chunks, full, tp_rank, tp_size)


def _copy_embedding_to_output_layer(chunks, full, tp_rank, tp_size):
    """With tied weights on a PP>1 last stage, output_layer.weight mirrors the embedding."""
    for chunk in chunks:
        out = getattr(chunk, "output_layer", None)
        if out is None or getattr(chunk, "pre_process", True) or out.weight is None:
            continue
        source = full["embedding.word_embeddings.weight"]
        padded_rows = out.weight.shape[0] * tp_size
        pad = torch.zeros((padded_rows - source.shape[0], source.shape[1]), dtype=source.dtype)
        with torch.no_grad():
            out.weight.copy_(
                shard_tensor(torch.cat([source, pad]), "output_layer.weight", out.weight, tp_rank, tp_size)
            )
