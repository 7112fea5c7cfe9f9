"""Hugging Face safetensors <-> Megatron GPTModel weights for the Llama-3.x, Qwen2/Qwen2.5 and Qwen3 families (and
their MoE variants); DeepSeek-V3's and GPT-OSS's own tensors are mapped in models/hf_deepseek.py and
models/hf_gpt_oss.py, config.json in models/hf_config.py, the checkpoint files read in models/hf_checkpoint.py.

The Megatron side is the *full layout* of :mod:`megatron_kl.models.state` (TP=1/PP=1 names, global layer
indices, vocabulary trimmed to ``vocab_size``); ``state.load_full_state_dict`` / ``state.iter_full_state``
shard and gather it for any TP/PP layout. Tensors are converted one Megatron parameter at a time
(``HFStateView`` reads only the HF tensors that parameter needs, lazily from the safetensors files), so a
7-8B model converts without two full copies in memory.

Mapping (layer i; ``d`` = head dim, ``ng`` query groups, ``nq`` heads):

    model.embed_tokens.weight                      embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight          decoder.layers.i.input_layernorm.weight
                                                   (Transformer Engine spec: ...self_attention.linear_qkv.layer_norm_weight)
    self_attn.{q,k,v}_proj.{weight,bias}           self_attention.linear_qkv.{weight,bias}: per query group g,
                                                   [q heads of g (nq/ng x d rows); k_g (d); v_g (d)]
    self_attn.o_proj.weight                        self_attention.linear_proj.weight
    self_attn.{q,k}_norm.weight (Qwen3)            self_attention.{q,k}_layernorm.weight
    post_attention_layernorm.weight                pre_mlp_layernorm.weight (TE: mlp.linear_fc1.layer_norm_weight)
    mlp.{gate,up}_proj.weight                      mlp.linear_fc1.weight = [gate; up]
    mlp.down_proj.weight                           mlp.linear_fc2.weight
    model.norm.weight                              decoder.final_layernorm.weight
    lm_head.weight (absent when tied)              output_layer.weight

Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE; expert j by its global index):

    mlp.gate.weight                                mlp.router.weight
    mlp.experts.j.{gate,up}_proj.weight            mlp.experts.local_experts.j.linear_fc1.weight = [gate; up]
    mlp.experts.j.down_proj.weight                 mlp.experts.local_experts.j.linear_fc2.weight
    mlp.shared_expert.{gate,up}_proj.weight        mlp.shared_experts.linear_fc1.weight = [gate; up]
    mlp.shared_expert.down_proj.weight             mlp.shared_experts.linear_fc2.weight
    mlp.shared_expert_gate.weight                  mlp.shared_experts.gate_weight
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_kl.config import ConfigError, ModelConfig  # noqa: F401 - ConfigError: part of this module's API
from megatron_kl.models.hf_checkpoint import HFCheckpoint, HFCheckpointError  # noqa: F401 - this module's API
from megatron_kl.models.hf_config import (  # noqa: F401
    LLAMA3_ROPE_FIXED,
    MOE_STRUCTURAL_FIELDS,
    STRUCTURAL_FIELDS,
    check_model_config,
    family_mapping,
    hf_config_from_model,
    model_config_from_hf,
)
from megatron_kl.models.state import iter_full_state, load_full_state_dict


def _hook(model: ModelConfig, name: str):
    """A family mapping's optional function (``to_megatron``, ``to_hf``, ``expert_of``, ``expert_to_megatron``,
    ``ExpertFuser``: ModelFamily's doc), or None where the family has no mapping or no such step."""
    mapping = family_mapping(model)
    return getattr(mapping, name, None) if mapping is not None else None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


# ---------------------------------------------------------------------------------------------- tensors

_PLAIN = {  # megatron suffix within a layer -> HF suffix within model.layers.i.
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_MOE_PLAIN = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_EXPERT_SUFFIX = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_names(megatron_name: str, model: Optional[ModelConfig] = None) -> list[str]:
    """The HF tensors a Megatron full-layout parameter is built from (in merge order); ``model`` names the
    family where its names differ (DeepSeek-V3: models/hf_deepseek.py)."""
    if megatron_name in _GLOBAL:
        return [_GLOBAL[megatron_name]]
    match = _LAYER.match(megatron_name)
    if not match:
        raise KeyError(f"no HF mapping for Megatron tensor {megatron_name!r}")
    prefix, suffix = f"model.layers.{match.group(1)}.", match.group(2)
    mapping = family_mapping(model) if model is not None else None
    if mapping is not None:
        names = mapping.layer_hf_names(suffix)
        if names is not None:
            return [prefix + name for name in names]
    if suffix in _PLAIN:
        return [prefix + _PLAIN[suffix]]
    if suffix in _MOE_PLAIN:
        return [prefix + _MOE_PLAIN[suffix]]
    expert = _EXPERT_SUFFIX.match(suffix)
    if expert:
        base = f"{prefix}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc2":
            return [base + "down_proj.weight"]
        return [base + "gate_proj.weight", base + "up_proj.weight"]
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        return [prefix + "mlp.shared_expert.gate_proj.weight", prefix + "mlp.shared_expert.up_proj.weight"]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
    if suffix == "mlp.linear_fc1.weight":
        return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    raise KeyError(f"no HF mapping for Megatron tensor {megatron_name!r}")


def _qkv_merge(q, k, v, groups: int) -> torch.Tensor:
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1
    ).reshape(-1, *rest)


def _qkv_split(qkv, model: ModelConfig) -> list[torch.Tensor]:
    m = model.resolved()
    d, groups = m.kv_channels, m.num_query_groups
    per_group = m.num_attention_heads // groups * d
    grouped = qkv.reshape(groups, per_group + 2 * d, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [per_group, d, d], dim=1)
    return [t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v)]


def to_megatron(megatron_name: str, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """The full-layout Megatron tensor from its HF tensors (``hf_names`` order)."""
    layer, convert = _LAYER.match(megatron_name), _hook(model, "to_megatron")
    if convert is not None and layer:
        tensors = [convert(layer.group(2), t, model) for t in tensors]
    if ".linear_qkv." in megatron_name and not megatron_name.endswith("layer_norm_weight"):
        return _qkv_merge(*tensors, groups=model.resolved().num_query_groups)
    if megatron_name.endswith("linear_fc1.weight"):  # a SwiGLU [gate; up]: dense, routed or shared expert
        return torch.cat(tensors, dim=0)
    return tensors[0]


def to_hf(megatron_name: str, tensor: torch.Tensor, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_megatron`: HF name -> tensor (GPT-OSS's experts go through :func:`to_hf_stream`)."""
    names = hf_names(megatron_name, model)
    layer, convert = _LAYER.match(megatron_name), _hook(model, "to_hf")
    if convert is not None and layer:
        tensor = convert(layer.group(2), tensor, model)
    if len(names) == 3:
        return dict(zip(names, _qkv_split(tensor, model)))
    if len(names) == 2:
        return dict(zip(names, (t.contiguous() for t in torch.chunk(tensor, 2, dim=0))))
    return {names[0]: tensor}


class HFStateView(Mapping):
    """The Megatron full-layout state of an HF checkpoint, built one tensor at a time on access
    (what ``state.load_full_state_dict`` streams from)."""

    def __init__(self, checkpoint: HFCheckpoint, model: ModelConfig):
        self.checkpoint, self.model = checkpoint, model

    def __getitem__(self, name: str) -> torch.Tensor:
        sources = hf_names(name, self.model)
        expert = self._fused_expert(name)
        if expert is not None:  # GPT-OSS: one row of the layer's fused expert tensor
            index, kind = expert
            return _hook(self.model, "expert_to_megatron")(kind, self.checkpoint.get_row(sources[0], index))
        tensors = []
        for source in sources:
            try:
                tensors.append(self.checkpoint.get(source))
            except KeyError as err:
                raise KeyError(f"{err.args[0]} (needed for Megatron tensor {name!r})") from None
        return to_megatron(name, tensors, self.model)

    def _fused_expert(self, name: str):
        match, expert_of = _LAYER.match(name), _hook(self.model, "expert_of")
        if expert_of is None or match is None:
            return None
        return expert_of(match.group(2))

    def __contains__(self, name) -> bool:
        try:
            hf_names(name, self.model)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        raise TypeError("HFStateView is accessed by name only (it is built lazily)")

    def __len__(self) -> int:
        return len(self.checkpoint.files)


# ---------------------------------------------------------------------------------------------- export


def write_hf(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    model: ModelConfig,
    out_dir,
    dtype: str,
    source_dir=None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write Megatron full-layout tensors (streamed) as an HF checkpoint (see :func:`write_hf_tensors`)."""

    return write_hf_tensors(to_hf_stream(named_tensors, model), model, out_dir, dtype, source_dir, max_shard_bytes)


def to_hf_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]], model: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron full-layout tensors (streamed) as HF-named tensors: a tied output layer left out, GPT-OSS's experts
    fused per layer (models/hf_gpt_oss.ExpertFuser)."""
    fuser_class, expert_of = _hook(model, "ExpertFuser"), _hook(model, "expert_of")
    fuser = fuser_class(model.moe.num_experts) if fuser_class is not None else None
    for megatron_name, tensor in named_tensors:
        if model.tie_word_embeddings and megatron_name == "output_layer.weight":
            continue
        layer = _LAYER.match(megatron_name)
        if fuser is not None and layer and expert_of(layer.group(2)):
            yield from fuser.add(megatron_name, tensor)
            continue
        yield from to_hf(megatron_name, tensor, model).items()
    if fuser is not None:
        fuser.check_done()


def write_hf_tensors(
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    model: ModelConfig,
    out_dir,
    dtype: str,
    source_dir=None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write HF-named tensors (streamed) as an HF checkpoint: size-capped safetensors shards with an index,
    config.json (the source's, when given, else derived from ``model``) and the source's tokenizer files."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    written: list[tuple[str, list[str]]] = []
    storages: set[int] = set()  # safetensors refuses tensors sharing memory (a tied lm_head sent as the embedding)

    def flush():
        nonlocal size
        if shards[-1]:
            name = f"model-{len(written) + 1:05d}.safetensors.part"
            save_file(shards[-1], str(out / name), metadata={"format": "pt"})
            written.append((name, list(shards[-1])))
            shards[-1] = {}
            storages.clear()
            size = 0

    for name, value in hf_tensors:
        value = value.detach().to("cpu", torch_dtype).contiguous()
        if value.untyped_storage().data_ptr() in storages:
            value = value.clone()
        storages.add(value.untyped_storage().data_ptr())
        shards[-1][name] = value
        size += value.numel() * value.element_size()
        if size >= max_shard_bytes:
            flush()
    flush()
    weight_map = {}
    total = len(written)
    for i, (part, names) in enumerate(written):
        final = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        (out / part).rename(out / final)
        weight_map.update({n: final for n in names})
    if total > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2, sort_keys=True)
        )
    config = hf_config_from_model(model, dtype)
    if source_dir is not None and (Path(source_dir) / "config.json").is_file():
        config = json.loads((Path(source_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if source_dir is not None:
        copy_tokenizer(source_dir, out)
    return out


def copy_tokenizer(source_dir, out_dir) -> list[str]:
    """Carry the tokenizer files and chat template along; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied


def model_config_for_run(given: Optional[ModelConfig], checkpoint: HFCheckpoint) -> ModelConfig:
    """The run's ModelConfig: the checkpoint's, with the run's non-structural choices when one is given.

    A structural field left at its ModelConfig default is completed from config.json (so a YAML needs no
    model section beyond its choices, e.g. no ``norm_epsilon: 9.999999747378752e-06``); one set to another
    value must match config.json, or it is a ConfigError naming the field."""
    derived = checkpoint.model_config()
    if given is None:
        return derived
    defaults = ModelConfig()
    unset = {k: getattr(derived, k) for k in STRUCTURAL_FIELDS if getattr(given, k) == getattr(defaults, k)}
    moe_unset = {
        k: getattr(derived.moe, k) for k in MOE_STRUCTURAL_FIELDS if getattr(given.moe, k) == getattr(defaults.moe, k)
    }
    given = dataclasses.replace(given, **unset, moe=dataclasses.replace(given.moe, **moe_unset))
    check_model_config(derived, given, f"{checkpoint.path}/config.json")
    moe = dataclasses.replace(given.moe, **{k: getattr(derived.moe, k) for k in MOE_STRUCTURAL_FIELDS})
    return dataclasses.replace(given, **{k: getattr(derived.resolved(), k) for k in STRUCTURAL_FIELDS}, moe=moe)


def load_hf_into(chunks: list, checkpoint: HFCheckpoint, model: ModelConfig, tp_group=None, experts=None) -> None:
    """Stream the HF weights into this rank's TP/PP shards of ``chunks`` (policy or reference); ``experts``: the
    routed experts' groups (models.state.ExpertGroups; default megatron-core's)."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    load_full_state_dict(
        chunks, HFStateView(checkpoint, model), model.tie_word_embeddings, tp_rank, tp_size, experts=experts
    )


def export_hf(
    chunks: list,
    model: ModelConfig,
    out_dir,
    dtype: str = "bfloat16",
    tp_group=None,
    pp_group=None,
    source_dir=None,
    max_shard_bytes: int = 2 << 30,
) -> Optional[Path]:
    """Collective: gather the model tensor by tensor and write it as an HF checkpoint on global rank 0
    (returns the directory there, None elsewhere)."""
    stream = iter_full_state(chunks, model.vocab_size, model.tie_word_embeddings, tp_group, pp_group)
    if dist.is_initialized() and dist.get_rank() != 0:
        for _ in stream:  # take part in the collectives
            pass
        return None
    return write_hf(stream, model, out_dir, dtype, source_dir=source_dir, max_shard_bytes=max_shard_bytes)
