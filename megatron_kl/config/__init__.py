"""Typed, nested configuration with validation: the ``model:`` and ``parallel:`` sections, the model families, and
the loader every section shares (YAML, dotted overrides, ``from_dict``: in ``loader.py``). The ``launch:`` section is in
:mod:`megatron_kl.config.launch`; the trainer's sections beside the code they configure (``kl/config.py``, ...).

Every axis is a named field a user can set in YAML (``model.num_layers: 4``) or on the command line as a
dotted override (``parallel.tensor_parallel=2``). ``validate_*`` functions run before any process group
exists and raise :class:`ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_kl.config.loader import (  # noqa: F401 - the loader is part of this API
    apply_overrides,
    from_dict,
    load_yaml,
    parse_yaml,
    read_yaml_file,
    redact_secrets,
    to_dict,
)
from megatron_kl.constraints import ConfigError, check_declared, checked
from megatron_kl.model_variants import (  # noqa: F401
    MOE_DISPATCHERS,
    ROUTER_SCORES,
    ROUTING_REPLAY,
    MLAConfig,
    MoEConfig,
    YarnConfig,
    validate_moe,
)
from megatron_kl.redaction import REDACTED, redact_config  # noqa: F401 - REDACTED: part of this API
from megatron_kl.registry import Registry


@dataclass(frozen=True)
class ModelFamily:
    """A model family (``model.architecture``): what its name fills in and how it maps to HF.

    ``defaults``: values for the ModelConfig fields left None (qkv_bias, qk_layernorm, rope_theta);
    ``multi_latent_attention``: DeepSeek-V3's attention (``model.mla``); ``hf_classes``: each HF ``model_type`` that is
    this family and the ``architectures`` class config.json names for it (the first: the dense model, ``*_moe``: its
    mixture-of-experts variant); ``hf_mapping``: the module (or object) that maps config.json and tensors where the
    family's differ from Llama's - ``model_config_values(hf, rope)``, ``hf_config(model, dtype)``,
    ``layer_hf_names(suffix)``, ``to_megatron`` / ``to_hf`` (models/hf_deepseek.py is the example); None: Llama's
    names. ``layer_spec(model, spec, dense) -> spec``: a seam to change the megatron-core layer spec the builder made
    (swap a submodule: models/builder.layer_spec), None to keep it. Built-ins below; a family from outside the
    package is ``MODEL_FAMILIES.register(...)`` or ``model.architecture: package.module:FAMILY``."""

    name: str
    defaults: dict = field(default_factory=dict)
    multi_latent_attention: bool = False
    hf_classes: dict = field(default_factory=dict)
    hf_mapping: Any = None
    layer_spec: Any = None
    description: str = ""

    def mapping(self):
        """The HF mapping module (imported by name on first use), or None for Llama's names."""
        if isinstance(self.hf_mapping, str):
            return importlib.import_module(self.hf_mapping)
        return self.hf_mapping


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family", ModelFamily)
for _family in (
    ModelFamily(
        "llama",
        {"qkv_bias": False, "qk_layernorm": False, "rope_theta": 500000.0},
        hf_classes={"llama": "LlamaForCausalLM"},
        description="Llama-3.x",
    ),
    ModelFamily(
        "qwen2",
        {"qkv_bias": True, "qk_layernorm": False, "rope_theta": 1000000.0},
        hf_classes={"qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"},
        description="Qwen2 / Qwen2.5 and Qwen2-MoE",
    ),
    ModelFamily(
        "qwen3",
        {"qkv_bias": False, "qk_layernorm": True, "rope_theta": 1000000.0},
        hf_classes={"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"},
        description="Qwen3 and Qwen3-MoE",
    ),
    # multi-latent attention (model.mla), its latents RMS-normalised (qk_layernorm); MoE with model.moe
    ModelFamily(
        "deepseek_v3",
        {"qkv_bias": False, "qk_layernorm": True, "rope_theta": 10000.0},
        multi_latent_attention=True,
        hf_classes={"deepseek_v3": "DeepseekV3ForCausalLM"},
        hf_mapping="megatron_kl.models.hf_deepseek",
        description="DeepSeek-V3 / Moonlight / Kimi",
    ),
    # attention sinks, sliding and full layers, biases everywhere, the clamped GLU (set by the fields below)
    ModelFamily(
        "gpt_oss",
        {"qkv_bias": True, "qk_layernorm": False, "rope_theta": 150000.0},
        hf_classes={"gpt_oss": "GptOssForCausalLM"},
        hf_mapping="megatron_kl.models.hf_gpt_oss",
        description="GPT-OSS",
    ),
):
    MODEL_FAMILIES.register(_family)


def model_family(name: str) -> ModelFamily:
    return MODEL_FAMILIES.get(name, "model.architecture")


DTYPES = ("float32", "bfloat16", "float16")
GLU_ACTIVATIONS = ("silu", "quick_gelu")

LOGPROB_PATHS = ("auto", "fused", "unfused")
FUSED_GRADS = ("auto", "in_forward", "recompute")
RECOMPUTE = ("none", "full")
CORE_ATTENTION = ("auto", "sdpa", "unfused")
RMS_NORMS = ("auto", "lean", "torch")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer in the Llama / Qwen2 / Qwen3 family (RMSNorm, SwiGLU, GQA, RoPE), dense or
    with mixture-of-experts MLPs (``moe``), or DeepSeek-V3 (multi-latent attention: ``mla``)."""

    # llama | qwen2 | qwen3 | deepseek_v3 | gpt_oss | a registered family (MODEL_FAMILIES) | package.module:FAMILY
    architecture: str = checked("qwen2", choices=MODEL_FAMILIES)
    num_layers: int = checked(2, ge=1)
    hidden_size: int = checked(64, ge=1)
    ffn_hidden_size: int = checked(128, ge=1)
    num_attention_heads: int = checked(4, ge=1)
    num_query_groups: int = checked(2, ge=1)
    kv_channels: Optional[int] = checked(None, ge=1)  # head dim; default hidden_size // num_attention_heads
    vocab_size: int = checked(32, ge=1)
    max_position_embeddings: int = checked(256, ge=1)
    rope_theta: Optional[float] = checked(None, gt=0)
    rope_scaling_factor: Optional[float] = checked(None, gt=0)  # Llama-3.1 style frequency scaling when set
    yarn: YarnConfig = field(default_factory=YarnConfig)  # YaRN scaling (model.yarn.factor set): DeepSeek-V3
    norm_epsilon: float = checked(1e-6, gt=0)
    tie_word_embeddings: bool = False
    qkv_bias: Optional[bool] = None
    qk_layernorm: Optional[bool] = None
    make_vocab_size_divisible_by: int = checked(128, ge=1)
    params_dtype: str = checked("float32", choices=DTYPES)
    init_method_std: float = checked(0.02, gt=0)
    # how per-token log-probs / entropy / exact KL are computed on the last stage: "fused" never
    # materialises the logits (output projection inside the chunk loop), "unfused" runs the output layer
    # then the vocab-parallel stats, "auto" fuses forward-only passes and single-pass training microbatches of
    # at least one chunk, and a training microbatch that recomputes logits in backward when its logits
    # (tokens x V/tp) would exceed four fused chunks (models/pipeline.py VocabOptions.use_fused: measured)
    logprob_path: str = checked("auto", choices=LOGPROB_PATHS)
    logprob_chunk_rows: Optional[int] = checked(None, ge=1)  # rows per chunk on either path; None: automatic
    # fused path, training: in_forward forms the gradients in the forward sweep (no recomputed logits) when
    # the loss is row-separable, recompute always recomputes them in backward; auto = in_forward
    fused_grad: str = checked("auto", choices=FUSED_GRADS)
    # activation recomputation in training (megatron's recompute_granularity): "full" keeps only each layer's
    # input and recomputes the layer in backward (activation memory ~ layers x tokens x hidden, about one more
    # forward of compute); "none" keeps every activation. Frozen models (reference, engine) never recompute.
    recompute: str = checked("none", choices=RECOMPUTE)
    # core attention of the pure-PyTorch layer spec (no Transformer Engine): "sdpa" computes it with torch's
    # scaled_dot_product_attention (flash kernel, GQA without repeating keys; float32 math for 16-bit models on
    # the CPU), "unfused" keeps megatron-core's DotProductAttention, "auto" = sdpa for 16-bit params_dtype
    # (where megatron's bf16 batched GEMMs are slow), unfused for float32 (decoding no faster with sdpa; training
    # attention 2x faster but ~1 % of a step; runs stay bit-identical to earlier releases); TE's spec uses TE's own
    core_attention: str = checked("auto", choices=CORE_ATTENTION)
    # RMSNorm of the pure-PyTorch layer spec in training: "lean" saves only x and 1/rms for backward
    # (models/norm.py; as TE's and apex's fused norms do), "torch" keeps torch.nn.RMSNorm's composite graph (float32
    # copies of the activations), "auto" = lean for 16-bit params_dtype, torch in float32 (float32 runs stay
    # bit-identical to earlier releases)
    rms_norm: str = checked("auto", choices=RMS_NORMS)
    # GPT-OSS's attention and MLP (model.architecture gpt_oss; megatron-core's TransformerConfig fields in brackets):
    # a learnable logit per head in every softmax's denominator [softmax_type learnable], windowed layers whose
    # queries see the last sliding_window positions, themselves included [window_size], every full_attention_every-th
    # layer attending to all positions (null: every layer windowed) [window_attn_skip_freq], biases on every linear
    # layer - attention output, MLPs, experts, router [add_bias_linear]
    attention_sinks: bool = False
    sliding_window: Optional[int] = checked(None, ge=1)
    full_attention_every: Optional[int] = checked(None, ge=1)
    linear_bias: bool = False
    # the gated MLP act(gate) * (up + glu_up_offset) with gate clamped to <= glu_clamp and up to [-glu_clamp,
    # glu_clamp] (null: none); act: silu (SwiGLU) or quick_gelu = x sigmoid(1.702 x) (GPT-OSS)
    glu_activation: str = checked("silu", choices=GLU_ACTIVATIONS)
    glu_up_offset: float = checked(0.0, fix="GPT-OSS adds 1 to the up projection")
    glu_clamp: Optional[float] = checked(None, gt=0)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)  # the attention of model.architecture deepseek_v3

    @property
    def multi_latent_attention(self) -> bool:
        return model_family(self.architecture).multi_latent_attention

    def resolved(self) -> "ModelConfig":
        """A copy with the architecture defaults filled in for fields left as None."""
        validate_model(self)
        preset = model_family(self.architecture).defaults
        values = {k: (preset[k] if getattr(self, k) is None else getattr(self, k)) for k in preset}
        if self.multi_latent_attention:
            values["kv_channels"] = self.mla.v_head_dim  # megatron's core attention sizes its output by it
        elif self.kv_channels is None:
            values["kv_channels"] = self.hidden_size // self.num_attention_heads
        return dataclasses.replace(self, **values)

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's convention: pad V up to a multiple of make_vocab_size_divisible_by * TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel: int = checked(1, ge=1)
    pipeline_parallel: int = checked(1, ge=1)
    virtual_pipeline: Optional[int] = checked(None, ge=1)  # model chunks per pipeline rank (interleaved 1F1B)
    sequence_parallel: bool = False
    # each sequence split over context_parallel ranks (megatron-core's zigzag: 2 cp chunks, rank r holding chunks r
    # and 2cp-1-r); needs Transformer Engine's attention (GPUs); the loss side crosses the group exactly
    context_parallel: int = checked(1, ge=1)
    offload_reference: bool = False  # keep the reference model's weights on CPU between uses
    # mixture-of-experts layouts (model.moe): experts split over expert_parallel ranks (carved out of the data-
    # parallel ranks x TP, as megatron does), each expert's matrices over expert_tensor_parallel ranks (null:
    # the same as tensor_parallel)
    expert_parallel: int = checked(1, ge=1)
    expert_tensor_parallel: Optional[int] = checked(None, ge=1)
    # one timeout for every process group (torch.distributed's default group, megatron's TP/PP/DP groups,
    # the rollout engine's gloo group): a hung rank ends the job after this long instead of 30 min or never
    distributed_timeout_s: float = checked(
        1800.0, resumable=True, ge=10, fix="process groups need seconds to form: give at least 10"
    )

    @property
    def sequence_multiple(self) -> int:
        """:func:`sequence_multiple` of this layout."""
        return sequence_multiple(self.context_parallel, self.tensor_parallel, self.sequence_parallel)


def sequence_multiple(context_parallel: int, tensor_parallel: int, sequence_parallel: bool) -> int:
    """Sequences are padded to a multiple of this under context parallelism: 2 cp chunks, each split over the tp
    ranks with sequence parallelism (1 without context parallelism)."""
    if context_parallel == 1:
        return 1
    return 2 * context_parallel * (tensor_parallel if sequence_parallel else 1)


def validate_model(model: ModelConfig) -> None:
    """The model section's rules: each field's declared constraint (held for sections built in Python too), then the
    rules between fields."""
    check_declared(model, "model.")
    model_family(model.architecture)  # registered (or loadable), else a ConfigError naming the field
    if model.num_attention_heads % model.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={model.num_query_groups} must divide "
            f"model.num_attention_heads={model.num_attention_heads}"
        )
    if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by model.num_attention_heads="
            f"{model.num_attention_heads}; set model.kv_channels explicitly"
        )
    _validate_positions(model)
    validate_moe(model.moe)
    if model.moe.enabled and model.moe.first_dense_layers >= model.num_layers:
        raise ConfigError(
            f"model.moe.first_dense_layers={model.moe.first_dense_layers} leaves no mixture-of-experts "
            f"layer among model.num_layers={model.num_layers}; lower it (or set model.moe.num_experts=0)"
        )


def _validate_positions(model: ModelConfig) -> None:
    """Multi-latent attention's head layout and which RoPE scaling each attention takes."""
    if model.yarn.enabled and model.rope_scaling_factor is not None:
        raise ConfigError(
            "model.yarn.factor and model.rope_scaling_factor (llama3 scaling) are both set: a model has "
            "one RoPE scaling; keep the one its config.json names"
        )
    if model.full_attention_every is not None and model.sliding_window is None:
        raise ConfigError(
            f"model.full_attention_every={model.full_attention_every} without model.sliding_window: "
            "set the window, or full_attention_every to null"
        )
    if not model.multi_latent_attention:
        return
    if not model.yarn.truncate:
        raise ConfigError(
            "model.yarn.truncate=false with multi-latent attention: megatron-core's MLA rounds the YaRN "
            "correction range (truncate=true) only"
        )
    if model.rope_scaling_factor is not None:
        raise ConfigError(
            "model.rope_scaling_factor (llama3 scaling) with multi-latent attention: DeepSeek-V3 scales "
            "RoPE with YaRN; set model.yarn.factor instead"
        )
    if model.num_query_groups != model.num_attention_heads:
        raise ConfigError(
            f"model.num_query_groups={model.num_query_groups} with multi-latent attention: every head "
            f"has its own key from the latent; set it to model.num_attention_heads="
            f"{model.num_attention_heads}"
        )
    if model.mla.qk_rope_head_dim % 2:
        raise ConfigError(f"model.mla.qk_rope_head_dim={model.mla.qk_rope_head_dim} must be even (RoPE rotates pairs)")


def validate_parallel(model: ModelConfig, parallel: ParallelConfig, world_size: int) -> None:
    """Check that the parallel layout fits the model and the world, before any group is created."""
    validate_model(model)
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel.tensor_parallel={tp} and parallel.pipeline_parallel={pp} must be >= 1")
    if model.num_attention_heads % tp:
        raise ConfigError(
            f"parallel.tensor_parallel={tp} must divide model.num_attention_heads="
            f"{model.num_attention_heads}; pick a TP size among its divisors"
        )
    if model.num_query_groups % tp:
        raise ConfigError(
            f"parallel.tensor_parallel={tp} must divide model.num_query_groups={model.num_query_groups} "
            "(each TP rank holds whole KV heads); lower the TP size"
        )
    if model.ffn_hidden_size % tp:
        raise ConfigError(f"parallel.tensor_parallel={tp} must divide model.ffn_hidden_size={model.ffn_hidden_size}")
    if model.multi_latent_attention:
        mla = model.mla
        for name, width in (
            ("q_lora_rank", mla.q_lora_rank or tp),
            ("kv_lora_rank + qk_rope_head_dim", mla.kv_lora_rank + mla.qk_rope_head_dim),
        ):
            if width % tp:
                raise ConfigError(
                    f"parallel.tensor_parallel={tp} must divide model.mla.{name}={width} (megatron-core "
                    "splits multi-latent attention's down projections over the TP ranks)"
                )
    if model.padded_vocab_size(tp) % tp:
        raise ConfigError(
            f"the padded vocabulary {model.padded_vocab_size(tp)} is not divisible by "
            f"parallel.tensor_parallel={tp}; raise model.make_vocab_size_divisible_by"
        )
    if pp > model.num_layers:
        raise ConfigError(
            f"parallel.pipeline_parallel={pp} exceeds model.num_layers={model.num_layers}; "
            "every pipeline stage needs at least one layer"
        )
    chunks = pp * (parallel.virtual_pipeline or 1)
    if model.num_layers % chunks:
        raise ConfigError(
            f"model.num_layers={model.num_layers} must be divisible by parallel.pipeline_parallel"
            f"*virtual_pipeline={chunks}"
        )
    if parallel.virtual_pipeline is not None:
        raise ConfigError(
            "parallel.virtual_pipeline (interleaved 1F1B) is not supported yet: its gradients did not match "
            "PP=1 in the layout tests; set it to null and use pipeline_parallel alone"
        )
    cp = parallel.context_parallel
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor_parallel*pipeline_parallel*"
            f"context_parallel={tp * pp * cp}; launch a multiple of {tp * pp * cp} ranks"
        )
    _validate_context_parallel(model, parallel)
    if parallel.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_parallel > 1")
    _validate_expert_layout(model, parallel, world_size)


def validate_training_layout(model: ModelConfig, parallel: ParallelConfig, micro_batch_tokens: int = 0) -> None:
    """Layout rules of training only (forward-only uses - conversion, scoring - do not have them)."""
    if model.moe.enabled and parallel.expert_parallel > 1 and micro_batch_tokens > 0:
        raise ConfigError(
            f"train.micro_batch_tokens={micro_batch_tokens} with parallel.expert_parallel={parallel.expert_parallel}: "
            "token-budget microbatches differ in number and shape between data-parallel ranks, whose expert-parallel "
            "token dispatch must meet in every forward; set train.micro_batch_tokens=0 (equal microbatches)"
        )
    if model.multi_latent_attention and parallel.tensor_parallel > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            f"model.architecture={model.architecture} with parallel.tensor_parallel={parallel.tensor_parallel} trains "
            "only with parallel.sequence_parallel=true: without it megatron-core's multi-latent attention keeps each "
            "TP rank's part of the shared rotary key's gradient and adds the latent query norm's gradient once per "
            "rank (measured: 2x and ~1 % off at TP 2); sequence parallelism needs the Transformer Engine spec, on "
            "GPUs. Set sequence_parallel, or tensor_parallel=1 (forward-only uses run at any TP)"
        )
    if model.moe.enabled and parallel.tensor_parallel > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            f"model.moe with parallel.tensor_parallel={parallel.tensor_parallel} trains only with "
            "parallel.sequence_parallel=true (megatron-core's MoE layer refuses tensor parallelism without it in "
            "training; sequence parallelism needs the Transformer Engine spec, on GPUs): set sequence_parallel, or "
            "tensor_parallel=1 and split the experts with parallel.expert_parallel"
        )


def _validate_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """What context parallelism is combined with, and the positions its padding reaches (config only; that it
    needs Transformer Engine is checked where the model is built: models/context_parallel.check_runnable)."""
    cp = parallel.context_parallel
    if cp == 1:
        return
    if parallel.pipeline_parallel > 1 or parallel.virtual_pipeline is not None:
        raise ConfigError(
            f"parallel.context_parallel={cp} with parallel.pipeline_parallel="
            f"{parallel.pipeline_parallel}: the pipeline schedule's shapes under context parallelism are "
            "not supported here yet; set pipeline_parallel=1 (use tensor and context parallelism)"
        )
    if model.moe.enabled:
        raise ConfigError(
            f"parallel.context_parallel={cp} with a mixture-of-experts model (model.moe): routing "
            "replay and the expert layouts are not checked under context parallelism yet; set "
            "parallel.context_parallel=1"
        )
    multiple = parallel.sequence_multiple
    if model.max_position_embeddings % multiple:
        raise ConfigError(
            f"model.max_position_embeddings={model.max_position_embeddings} must be a multiple of "
            f"{multiple} (2 x parallel.context_parallel={cp}"
            f"{' x tensor_parallel with sequence_parallel' if multiple != 2 * cp else ''}): every "
            "sequence is padded to that multiple and its positions must stay within the model's"
        )


def _validate_expert_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int) -> None:
    """Megatron's expert layout: per pipeline stage, the tp x dp ranks are regrouped as etp x ep x edp."""
    ep, etp = parallel.expert_parallel, parallel.expert_tensor_parallel
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    moe = model.moe
    if ep < 1 or (etp is not None and etp < 1):
        raise ConfigError(f"parallel.expert_parallel={ep} and parallel.expert_tensor_parallel={etp} must be >= 1")
    if not moe.enabled:
        if ep != 1 or etp not in (None, tp):
            raise ConfigError(
                f"parallel.expert_parallel={ep} / expert_tensor_parallel={etp} need a mixture-of-"
                "experts model: set model.moe.num_experts, or leave them at 1 / null"
            )
        return
    etp = tp if etp is None else etp
    if model.linear_bias and etp > 1:
        raise ConfigError(
            f"model.linear_bias with parallel.expert_tensor_parallel={etp} (null: tensor_parallel): "
            "megatron-core adds the experts' biases with one expert-tensor-parallel rank only; set "
            "parallel.expert_tensor_parallel=1 (split the experts with expert_parallel instead)"
        )
    if moe.num_experts % ep:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.expert_parallel="
            f"{ep}: every expert-parallel rank holds the same number of experts; pick a divisor"
        )
    per_stage = world_size // pp
    if per_stage % (etp * ep):
        raise ConfigError(
            f"parallel.expert_tensor_parallel*expert_parallel={etp}x{ep} must divide the "
            f"{per_stage} ranks of a pipeline stage (world size {world_size} / "
            f"parallel.pipeline_parallel={pp}); change expert_parallel or the number of ranks"
        )
    expert_ffn = moe.ffn_hidden_size or model.ffn_hidden_size
    if expert_ffn % etp:
        raise ConfigError(
            f"parallel.expert_tensor_parallel={etp} must divide the expert width model.moe.ffn_hidden_size={expert_ffn}"
        )
    if moe.shared_expert_ffn_hidden_size % tp:
        raise ConfigError(
            f"parallel.tensor_parallel={tp} must divide model.moe.shared_expert_ffn_hidden_size="
            f"{moe.shared_expert_ffn_hidden_size}"
        )


@dataclass(frozen=True)
class ModelParallelConfig:
    """The model/parallel part of a job config (the trainer's config nests this shape)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
