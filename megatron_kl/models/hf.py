"""Hugging Face safetensors <-> Megatron GPTModel weights for the Llama-3.x, Qwen2/Qwen2.5 and Qwen3 families.

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

from megatron_kl.config import ConfigError, ModelConfig, MoEConfig
from megatron_kl.models import hf_deepseek

# HF model_type -> ModelConfig.architecture (the *_moe types: the same attention, mixture-of-experts MLPs)
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3",
            hf_deepseek.MODEL_TYPE: "deepseek_v3"}
HF_ARCHITECTURE_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                         "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                         hf_deepseek.MODEL_TYPE: hf_deepseek.HF_CLASS}
MOE_STRUCTURAL_FIELDS = ("num_experts", "router_topk", "ffn_hidden_size", "shared_expert_ffn_hidden_size",
                         "normalize_topk", "shared_expert_gate", "score_function", "expert_bias", "num_groups",
                         "group_topk", "routed_scaling_factor", "first_dense_layers")
# megatron-core's llama3 RoPE scaling fixes these (RotaryEmbedding._apply_scaling); only the factor is free
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
# fields of ModelConfig that describe the weights (checked against config.json); the rest are run choices
STRUCTURAL_FIELDS = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "kv_channels", "vocab_size", "rope_theta", "rope_scaling_factor",
                     "norm_epsilon", "tie_word_embeddings", "qkv_bias", "qk_layernorm", "mla", "yarn")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


# ---------------------------------------------------------------------------------------------- configs

def _rope(hf: dict) -> dict:
    """RoPE settings from either config.json style: transformers>=5 ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    if hf.get("rope_parameters"):
        return dict(hf["rope_parameters"])
    return {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """The ModelConfig of an HF ``config.json`` (dict). Unsupported features are ConfigErrors naming the key."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json model_type={model_type!r} is not supported; use one of {sorted(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    for key in ("mlp_bias", "use_sliding_window"):
        if hf.get(key):
            raise ConfigError(f"config.json {key}=true is not supported by the Megatron mapping")
    rope = _rope(hf)
    if model_type == hf_deepseek.MODEL_TYPE:
        return ModelConfig(**{**hf_deepseek.model_config_values(hf, rope), **overrides})
    if model_type == "llama" and hf.get("attention_bias"):
        raise ConfigError("config.json attention_bias=true (an o_proj bias) is not supported; Llama-3.x has none")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        for key, fixed in LLAMA3_ROPE_FIXED.items():
            if key in rope and float(rope[key]) != fixed:
                raise ConfigError(f"config.json rope {key}={rope[key]}: megatron-core's llama3 RoPE scaling fixes it "
                                  f"to {fixed}")
        scaling = float(rope["factor"])
    elif rope_type not in ("default", None):
        raise ConfigError(f"config.json rope_type={rope_type!r} is not supported (default or llama3)")
    heads = hf["num_attention_heads"]
    moe = _moe_from_hf(hf) if model_type.endswith("_moe") else MoEConfig()
    values = dict(
        architecture=FAMILIES[model_type],
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling_factor=scaling,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type in ("qwen2", "qwen2_moe") else bool(hf.get("attention_bias", False)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        moe=moe,
    )
    values.update(overrides)
    return ModelConfig(**values)


def _moe_from_hf(hf: dict) -> MoEConfig:
    """model.moe of a qwen2_moe / qwen3_moe config.json: every layer sparse (decoder_sparse_step 1, no
    mlp_only_layers), the router's top-k renormalised as norm_topk_prob says, Qwen2-MoE's shared expert."""
    step = hf.get("decoder_sparse_step", 1)
    if step != 1 or hf.get("mlp_only_layers"):
        raise ConfigError(f"config.json decoder_sparse_step={step} / mlp_only_layers={hf.get('mlp_only_layers')}: "
                          "dense layers among the sparse ones are not supported; every layer must be sparse")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise ConfigError("config.json of a mixture-of-experts model has no num_experts (or num_local_experts)")
    return MoEConfig(num_experts=int(experts), router_topk=int(hf["num_experts_per_tok"]),
                     ffn_hidden_size=int(hf["moe_intermediate_size"]),
                     shared_expert_ffn_hidden_size=int(hf.get("shared_expert_intermediate_size") or 0),
                     normalize_topk=bool(hf.get("norm_topk_prob", False)))


def check_model_config(derived: ModelConfig, given: ModelConfig, source: str = "the HF checkpoint") -> None:
    """Raise a ConfigError naming every structural field where ``given`` (the run's model config) differs
    from ``derived`` (read from the checkpoint)."""
    a, b = derived.resolved(), given.resolved()
    diffs = [f"model.{k}={getattr(b, k)!r} but {source} has {getattr(a, k)!r}"
             for k in STRUCTURAL_FIELDS if getattr(a, k) != getattr(b, k)]
    if a.moe.enabled or b.moe.enabled:
        diffs += [f"model.moe.{k}={getattr(b.moe, k)!r} but {source} has {getattr(a.moe, k)!r}"
                  for k in MOE_STRUCTURAL_FIELDS
                  if _expert_width(a, k) != _expert_width(b, k)]
    if diffs:
        raise ConfigError("model config does not match the checkpoint: " + "; ".join(diffs)
                          + " (make the model section of the YAML match config.json)")


def _expert_width(model: ModelConfig, key: str):
    """model.moe.<key>, the expert width resolved (null means model.ffn_hidden_size)."""
    if key == "ffn_hidden_size" and model.moe.enabled:
        return model.moe.ffn_hidden_size or model.ffn_hidden_size
    return getattr(model.moe, key)


def hf_config_from_model(model: ModelConfig, dtype: str = "bfloat16") -> dict:
    """A config.json for ``model`` (used when exporting without an original config.json)."""
    m = model.resolved()
    family = m.architecture
    if family == "deepseek_v3":
        return hf_deepseek.hf_config(m, dtype)
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "factor": m.rope_scaling_factor, "rope_theta": m.rope_theta, **LLAMA3_ROPE_FIXED}
    config = {
        "architectures": [HF_ARCHITECTURE_CLASS[family]], "model_type": family, "hidden_act": "silu",
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels, "vocab_size": m.vocab_size, "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon, "tie_word_embeddings": m.tie_word_embeddings, "rope_theta": m.rope_theta,
        "rope_scaling": None if m.rope_scaling_factor is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        "torch_dtype": dtype, "dtype": dtype,
    }
    if family == "llama":
        config.update(attention_bias=bool(m.qkv_bias), mlp_bias=False)
    if m.moe.enabled:
        if family == "llama":
            raise ConfigError("model.moe with model.architecture=llama has no HF format; use qwen2 or qwen3")
        model_type = f"{family}_moe"
        config.update(architectures=[HF_ARCHITECTURE_CLASS[model_type]], model_type=model_type,
                      num_experts=m.moe.num_experts, num_experts_per_tok=m.moe.router_topk,
                      moe_intermediate_size=m.moe.ffn_hidden_size or m.ffn_hidden_size,
                      norm_topk_prob=m.moe.normalize_topk, decoder_sparse_step=1, mlp_only_layers=[],
                      router_aux_loss_coef=m.moe.aux_loss_coeff, output_router_logits=False)
        if family == "qwen2":
            config.update(shared_expert_intermediate_size=m.moe.shared_expert_ffn_hidden_size)
        elif m.moe.shared_expert_ffn_hidden_size:
            raise ConfigError("model.moe.shared_expert_ffn_hidden_size with qwen3 has no HF format (Qwen3-MoE has no "
                              "shared expert); set it to 0 or use model.architecture=qwen2")
    return config


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
_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


def hf_names(megatron_name: str, model: Optional[ModelConfig] = None) -> list[str]:
    """The HF tensors a Megatron full-layout parameter is built from (in merge order); ``model`` names the
    family where its names differ (DeepSeek-V3: models/hf_deepseek.py)."""
    if megatron_name in _GLOBAL:
        return [_GLOBAL[megatron_name]]
    match = _LAYER.match(megatron_name)
    if not match:
        raise KeyError(f"no HF mapping for Megatron tensor {megatron_name!r}")
    prefix, suffix = f"model.layers.{match.group(1)}.", match.group(2)
    if model is not None and model.multi_latent_attention:
        names = hf_deepseek.layer_hf_names(suffix)
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
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _qkv_split(qkv, model: ModelConfig) -> list[torch.Tensor]:
    m = model.resolved()
    d, groups = m.kv_channels, m.num_query_groups
    per_group = m.num_attention_heads // groups * d
    grouped = qkv.reshape(groups, per_group + 2 * d, *qkv.shape[1:])
    q, k, v = torch.split(grouped, [per_group, d, d], dim=1)
    return [t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v)]


def to_megatron(megatron_name: str, tensors: list[torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """The full-layout Megatron tensor from its HF tensors (``hf_names`` order)."""
    if model.multi_latent_attention and _LAYER.match(megatron_name):
        tensors = [hf_deepseek.to_megatron(_LAYER.match(megatron_name).group(2), t, model) for t in tensors]
    if ".linear_qkv." in megatron_name and not megatron_name.endswith("layer_norm_weight"):
        return _qkv_merge(*tensors, groups=model.resolved().num_query_groups)
    if megatron_name.endswith("linear_fc1.weight"):  # a SwiGLU [gate; up]: dense, routed or shared expert
        return torch.cat(tensors, dim=0)
    return tensors[0]


def to_hf(megatron_name: str, tensor: torch.Tensor, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_megatron`: HF name -> tensor."""
    names = hf_names(megatron_name, model)
    if model.multi_latent_attention and _LAYER.match(megatron_name):
        tensor = hf_deepseek.to_hf(_LAYER.match(megatron_name).group(2), tensor, model)
    if len(names) == 3:
        return dict(zip(names, _qkv_split(tensor, model)))
    if len(names) == 2:
        return dict(zip(names, (t.contiguous() for t in torch.chunk(tensor, 2, dim=0))))
    return {names[0]: tensor}


class HFCheckpointError(ConfigError):
    """A file of an HF model directory is damaged or disagrees with another (the message names the file)."""


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"{path} is not valid JSON ({err}): the file is damaged or truncated; copy it again "
                                "from the model's source") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _safetensors(path: Path):
    """``safe_open`` of one file, a damaged one named (the library's own error says neither file nor fix)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: the file is what is wrong
        raise HFCheckpointError(f"{path} is not a readable safetensors file ({type(err).__name__}: {err}): it is "
                                "truncated or damaged; download or convert it again") from None


# one tensor per role and the config fields its shape follows (families without a name are not checked by it)
_SHAPES = (("model.embed_tokens.weight", ("vocab_size", "hidden_size")), ("model.norm.weight", ("hidden_size",)),
           ("model.layers.0.input_layernorm.weight", ("hidden_size",)),
           ("model.layers.0.mlp.up_proj.weight", ("intermediate_size", "hidden_size")))


class HFCheckpoint:
    """An HF model directory: config.json and safetensors (single file or sharded with an index),
    tensors read lazily one at a time. Damaged files are named (:class:`HFCheckpointError`)."""

    def __init__(self, path):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path} is not an HF model directory: config.json is missing")
        self.config = _json_file(config_file)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = _json_file(index_file).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise HFCheckpointError(f"{index_file} has no weight_map of tensor names to files: it is damaged")
            self.files = dict(weight_map)
        else:
            single = self.path / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"{self.path} has neither model.safetensors nor model.safetensors.index.json "
                                        "(only safetensors checkpoints are supported; re-save with safe_serialization)")
            with _safetensors(single) as f:
                self.files = {name: "model.safetensors" for name in f.keys()}
        self._handles: dict = {}

    def check_shapes(self) -> None:
        """Every file opens, and the weights' shapes agree with config.json (hidden size, vocabulary, MLP width):
        a disagreement names the field, its value, the tensor and its shape."""
        for file in sorted(set(self.files.values())):
            if not (self.path / file).is_file():
                raise HFCheckpointError(f"{self.path / file} is listed in the index but missing")
            self._handle(file)
        text_config = self.config.get("text_config") or self.config
        for name, fields in _SHAPES:
            if name not in self.files or not all(isinstance(text_config.get(f), int) for f in fields):
                continue
            expected = [text_config[f] for f in fields]
            shape = list(self._handle(self.files[name]).get_slice(name).get_shape())
            if shape != expected:
                said = ", ".join(f"{f}={v}" for f, v in zip(fields, expected))
                raise HFCheckpointError(f"{self.path / 'config.json'} says {said} but {self.path / self.files[name]} "
                                        f"holds {name} of shape {shape} (expected {expected}): config.json and the "
                                        "weights disagree; use the config.json the weights were saved with")

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = _safetensors(self.path / file)
        return self._handles[file]

    def model_config(self, **overrides) -> ModelConfig:
        return model_config_from_hf(self.config, **overrides)

    @property
    def dtype(self) -> str:
        return str(self.config.get("torch_dtype") or self.config.get("dtype") or "float32").replace("torch.", "")

    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids generation stops at: ``generation_config.json``'s ``eos_token_id`` (an int
        or a list, e.g. Llama-3.1-Instruct's [128001, 128008, 128009]), else config.json's; [] when neither."""
        for name in ("generation_config.json", "config.json"):
            path = self.path / name
            if not path.is_file():
                continue
            value = _json_file(path).get("eos_token_id")
            if value is None:
                continue
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise ValueError(f"{path}: eos_token_id={value!r} must be a token id or a list of them")
            return list(values)
        return []

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"HF checkpoint {self.path} lacks tensor {name!r}: the checkpoint is incomplete or not a "
                           f"{self.config.get('model_type')} model of this shape")
        file = self.files[name]
        try:
            return self._handle(file).get_tensor(name)
        except HFCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - a tensor whose bytes cannot be read
            raise HFCheckpointError(f"{self.path / file}: tensor {name!r} cannot be read ({type(err).__name__}: "
                                    f"{err}): the file is truncated or damaged; download or convert it again") from None


class HFStateView(Mapping):
    """The Megatron full-layout state of an HF checkpoint, built one tensor at a time on access
    (what ``state.load_full_state_dict`` streams from)."""

    def __init__(self, checkpoint: HFCheckpoint, model: ModelConfig):
        self.checkpoint, self.model = checkpoint, model

    def __getitem__(self, name: str) -> torch.Tensor:
        sources = hf_names(name, self.model)
        tensors = []
        for source in sources:
            try:
                tensors.append(self.checkpoint.get(source))
            except KeyError as err:
                raise KeyError(f"{err.args[0]} (needed for Megatron tensor {name!r})") from None
        return to_megatron(name, tensors, self.model)

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

def write_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], model: ModelConfig, out_dir, dtype: str,
             source_dir=None, max_shard_bytes: int = 2 << 30) -> Path:
    """Write Megatron full-layout tensors (streamed) as an HF checkpoint (see :func:`write_hf_tensors`)."""

    def hf_stream():
        for megatron_name, tensor in named_tensors:
            if model.tie_word_embeddings and megatron_name == "output_layer.weight":
                continue
            yield from to_hf(megatron_name, tensor, model).items()

    return write_hf_tensors(hf_stream(), model, out_dir, dtype, source_dir, max_shard_bytes)


def write_hf_tensors(hf_tensors: Iterable[tuple[str, torch.Tensor]], model: ModelConfig, out_dir, dtype: str,
                     source_dir=None, max_shard_bytes: int = 2 << 30) -> Path:
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
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2, sort_keys=True))
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
    moe_unset = {k: getattr(derived.moe, k) for k in MOE_STRUCTURAL_FIELDS
                 if getattr(given.moe, k) == getattr(defaults.moe, k)}
    given = dataclasses.replace(given, **unset, moe=dataclasses.replace(given.moe, **moe_unset))
    check_model_config(derived, given, f"{checkpoint.path}/config.json")
    moe = dataclasses.replace(given.moe, **{k: getattr(derived.moe, k) for k in MOE_STRUCTURAL_FIELDS})
    return dataclasses.replace(given, **{k: getattr(derived.resolved(), k) for k in STRUCTURAL_FIELDS}, moe=moe)


def load_hf_into(chunks: list, checkpoint: HFCheckpoint, model: ModelConfig, tp_group=None, experts=None) -> None:
    """Stream the HF weights into this rank's TP/PP shards of ``chunks`` (policy or reference); ``experts``: the
    routed experts' groups (models.state.ExpertGroups; default megatron-core's)."""
    import torch.distributed as dist

    from megatron_kl.models.state import load_full_state_dict

    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    load_full_state_dict(chunks, HFStateView(checkpoint, model), model.tie_word_embeddings, tp_rank, tp_size,
                         experts=experts)


def export_hf(chunks: list, model: ModelConfig, out_dir, dtype: str = "bfloat16", tp_group=None, pp_group=None,
              source_dir=None, max_shard_bytes: int = 2 << 30) -> Optional[Path]:
    """Collective: gather the model tensor by tensor and write it as an HF checkpoint on global rank 0
    (returns the directory there, None elsewhere)."""
    import torch.distributed as dist

    from megatron_kl.models.state import iter_full_state

    stream = iter_full_state(chunks, model.vocab_size, model.tie_word_embeddings, tp_group, pp_group)
    if dist.is_initialized() and dist.get_rank() != 0:
        for _ in stream:  # take part in the collectives
            pass
        return None
    return write_hf(stream, model, out_dir, dtype, source_dir=source_dir, max_shard_bytes=max_shard_bytes)
