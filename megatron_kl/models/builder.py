"""Build the policy and the reference as megatron.core GPTModel instances.

The layer spec is Transformer Engine's when ``transformer_engine`` imports (GPU clusters) and the
pure-PyTorch local spec otherwise. Weights are initialised on the CPU from a full master tensor and then
sliced (``use_cpu_initialization``), so any TP layout starts from the same weights as TP=1.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_kl.config import ConfigError, ModelConfig, ParallelConfig, model_family
from megatron_kl.models.context_parallel import check_runnable
from megatron_kl.models.norm import use_lean_rms_norm
from megatron_kl.models.routing_replay import attach_replay

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(model: ModelConfig, parallel: ParallelConfig, flash_decode: bool = False):
    """Megatron's TransformerConfig for ``model`` (MLATransformerConfig with multi-latent attention);
    ``flash_decode``: megatron's flash-decoding inference mode (RoPE applied once per new token, rotated keys
    cached; models/flash_decode.py), for the rollout engine."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    model = model.resolved()
    dtype = _DTYPES[model.params_dtype]
    config_class, attention = TransformerConfig, block_variant_fields(model)
    if model.multi_latent_attention:
        config_class, attention = MLATransformerConfig, {**attention, **mla_transformer_fields(model)}
    elif model.yarn.enabled:
        config_class = _yarn_config_class()
    return config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu if model.glu_activation == "silu" else _quick_gelu(),
        add_bias_linear=model.linear_bias,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        sequence_parallel=parallel.sequence_parallel,
        context_parallel_size=parallel.context_parallel,
        use_cpu_initialization=True,
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=False,
        flash_decode=flash_decode,
        **(
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if model.recompute == "full"
            else {}
        ),
        **moe_transformer_fields(model, parallel),
        **attention,
    )


def _quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


def block_variant_fields(model: ModelConfig) -> dict:
    """TransformerConfig fields of the attention sinks, sliding windows and the clamped GLU (GPT-OSS; any that are
    set), and of YaRN without multi-latent attention (GPT-OSS, Qwen long context) (GPTModel reads them from the config; the concentration factor
    mscale(f, mscale) / mscale(f, mscale_all_dim) multiplies cos and sin in the attention)."""
    fields = {}
    if model.attention_sinks:
        fields["softmax_type"] = "learnable"
    if model.sliding_window is not None:
        fields.update(window_size=(model.sliding_window - 1, 0), window_attn_skip_freq=model.full_attention_every)
    if model.glu_clamp is not None or model.glu_up_offset:
        fields.update(glu_linear_offset=model.glu_up_offset, activation_func_clamp_value=model.glu_clamp)
    yarn = model.yarn
    if yarn.enabled and not model.multi_latent_attention:
        fields.update(
            yarn_rotary_scaling_factor=yarn.factor,
            yarn_original_max_position_embeddings=yarn.original_max_position_embeddings,
            yarn_beta_fast=yarn.beta_fast,
            yarn_beta_slow=yarn.beta_slow,
            yarn_mscale=yarn.mscale,
            yarn_mscale_all_dim=yarn.mscale_all_dim,
            yarn_correction_range_round_to_int=yarn.truncate,
        )
    return fields


@functools.cache
def _yarn_config_class():
    """TransformerConfig with the YaRN fields megatron-core's GPTModel and attention read by name (its own config
    classes of YaRN models declare them the same way)."""
    from megatron.core.transformer import TransformerConfig

    @dataclasses.dataclass
    class YarnTransformerConfig(TransformerConfig):
        yarn_rotary_scaling_factor: float = 1.0
        yarn_original_max_position_embeddings: int = 4096
        yarn_beta_fast: float = 32.0
        yarn_beta_slow: float = 1.0
        yarn_mscale: float = 1.0
        yarn_mscale_all_dim: float = 0.0
        yarn_correction_range_round_to_int: bool = True

    return YarnTransformerConfig


def mla_transformer_fields(model: ModelConfig) -> dict:
    """MLATransformerConfig fields of ``model.mla`` and ``model.yarn`` (megatron's MLA applies RoPE and YaRN
    itself; its RoPE reads the rotary dimensions as interleaved pairs, as DeepSeek's checkpoints store them)."""
    mla, yarn = model.mla, model.yarn
    fields = dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rotary_base=model.rope_theta,
        rope_type="yarn" if yarn.enabled else "rope",
    )
    if yarn.enabled:
        fields.update(
            rotary_scaling_factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            mscale=yarn.mscale,
            mscale_all_dim=yarn.mscale_all_dim,
        )
    else:  # MLA's softmax scale reads the YaRN mscale even without YaRN: 1 at a factor of 1
        fields.update(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return fields


def moe_dispatcher(setting: str) -> str:
    """``model.moe.token_dispatcher`` resolved: megatron's alltoall dispatcher creates CUDA streams."""
    if setting == "auto":
        return "alltoall" if torch.cuda.is_available() else "allgather"
    if setting == "alltoall" and not torch.cuda.is_available():
        raise ConfigError(
            "model.moe.token_dispatcher=alltoall needs CUDA (megatron's alltoall dispatcher uses CUDA "
            "streams); use allgather or auto on the CPU"
        )
    return setting


def moe_transformer_fields(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """TransformerConfig fields of ``model.moe`` (none for a dense model). The router is the HF one: softmax
    over all experts then top-k (``moe_router_pre_softmax``) unless the kept probabilities are renormalised,
    which is the softmax over the top-k logits (megatron's default order)."""
    moe = model.moe
    if not moe.enabled:
        return {}
    fields = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size or model.ffn_hidden_size,
        moe_router_pre_softmax=not moe.normalize_topk,
        moe_router_score_function=moe.score_function,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=0.0,  # the bias is the checkpoint's, kept fixed
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.routed_scaling_factor,
        moe_layer_freq=[0] * moe.first_dense_layers + [1] * (model.num_layers - moe.first_dense_layers),
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_token_dispatcher_type=moe_dispatcher(moe.token_dispatcher),
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
        # replay is attached to the policy's routers alone (models/routing_replay.py), never to the reference's
        moe_enable_routing_replay=False,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel or parallel.tensor_parallel,
    )
    if moe.capacity_factor is not None:
        fields.update(
            moe_expert_capacity_factor=moe.capacity_factor,
            moe_token_drop_policy="probs",
            moe_pad_expert_input_to_capacity=False,
        )
    if moe.shared_expert_ffn_hidden_size:
        fields.update(
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
        )
    return fields


def _local_kernel(setting: str, kernel: str, model: ModelConfig) -> bool:
    """Whether a pure-PyTorch-spec kernel option (``model.core_attention``, ``model.rms_norm``) picks ``kernel``:
    set to it, or ``auto`` with 16-bit parameters (float32 keeps megatron's and torch's modules)."""
    return setting == kernel or (setting == "auto" and model.params_dtype != "float32")


def layer_spec(model: ModelConfig, dense: bool = False):
    """Transformer Engine spec where TE imports, Megatron's pure-PyTorch spec otherwise (its core attention
    by torch's SDPA or megatron's DotProductAttention: ``model.core_attention``); multi-latent attention for
    its families. ``dense``: the layer with a dense MLP in a mixture-of-experts model (its first dense layers). The
    family's ``layer_spec`` seam (config.ModelFamily) gets the spec last and may change its submodules."""
    from megatron.core.models.gpt import gpt_layer_specs

    model = model.resolved()
    experts = None if dense else (model.moe.num_experts or None)
    mla = model.multi_latent_attention
    family = model_family(model.architecture)
    if have_transformer_engine():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=model.qk_layernorm, multi_latent_attention=mla
        )
        return spec if family.layer_spec is None else family.layer_spec(model, spec, dense)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=experts,
        moe_grouped_gemm=False,
        qk_layernorm=model.qk_layernorm,
        normalization="RMSNorm",
        multi_latent_attention=mla,
    )
    from megatron_kl.models.attention import LatentDotProductAttention, SDPAttention

    if _local_kernel(model.core_attention, "sdpa", model):
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif mla:
        spec.submodules.self_attention.submodules.core_attention = LatentDotProductAttention
    return spec if family.layer_spec is None else family.layer_spec(model, spec, dense)


def decoder_spec(model: ModelConfig, config, vp_stage: Optional[int], pp_rank: int):
    """The spec of this pipeline stage's decoder: one layer spec repeated, or, with dense layers first in a
    mixture-of-experts model (``model.moe.first_dense_layers``), each of the stage's layers by its global index."""
    spec = layer_spec(model)
    if not (model.moe.enabled and model.moe.first_dense_layers):
        return spec
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = layer_spec(model, dense=True)
    first = get_transformer_layer_offset(config, vp_stage, pp_rank)
    layers = range(first, first + get_num_layers_to_build(config, vp_stage, pp_rank))
    return TransformerBlockSubmodules(
        layer_specs=[dense if index < model.moe.first_dense_layers else spec for index in layers],
        layer_norm=LayerNormImpl,
    )


def build_gpt_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    vp_stage: Optional[int] = None,
    pg_collection=None,
    flash_decode: bool = False,
    whole: bool = False,
    stage: Optional[tuple[bool, bool]] = None,
):
    """One GPTModel chunk for this rank's pipeline stage (and virtual stage ``vp_stage``).

    ``pg_collection`` (megatron's ProcessGroupCollection) defaults to parallel_state's groups; the
    embedded rollout engine passes its own TP group so it can run concurrently with training, and
    ``flash_decode`` (see :func:`transformer_config`). ``whole``: every layer on this rank, embedding to output
    layer, whatever the trainer's pipeline stage (a model in a layout of its own: models/parallel.OwnLayout);
    ``stage``: (first, last) pipeline stage of such a layout's own pipeline instead of the trainer's.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    resolved = model.resolved()
    check_runnable(parallel, have_transformer_engine())
    if parallel.sequence_parallel and not have_transformer_engine():
        raise ConfigError(
            "parallel.sequence_parallel=true needs the Transformer Engine layer spec (megatron-core's "
            "pure-PyTorch RMSNorm does not support it): install the `gpu` extra, or set it to false"
        )
    config = transformer_config(resolved, parallel, flash_decode=flash_decode)
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        pp_rank = torch.distributed.get_rank(pg_collection.pp)
    else:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(resolved, config, vp_stage, pp_rank),
        vocab_size=resolved.padded_vocab_size(parallel.tensor_parallel),
        max_sequence_length=resolved.max_position_embeddings,
        pre_process=whole
        or (
            stage[0]
            if stage is not None
            else parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        ),
        post_process=whole
        or (
            stage[1]
            if stage is not None
            else parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        ),
        parallel_output=True,
        share_embeddings_and_output_weights=resolved.tie_word_embeddings,
        position_embedding_type="yarn" if resolved.yarn.enabled and not resolved.multi_latent_attention else "rope",
        rotary_base=int(resolved.rope_theta),
        rope_scaling=resolved.rope_scaling_factor is not None,
        rope_scaling_factor=resolved.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    frozen_expert_bias(gpt)
    _mark_sinks_sharded(gpt)
    if resolved.linear_bias and resolved.moe.enabled:
        _expert_outputs_out_of_place(gpt)
    if not have_transformer_engine() and _local_kernel(resolved.rms_norm, "lean", resolved):
        use_lean_rms_norm(gpt)  # the local spec's torch RMSNorm, saving x and 1/rms for backward (models/norm.py)
    if config.params_dtype != torch.float32:
        # what megatron's Float16Module does on a GPU: every parameter in the 16-bit dtype (the local spec's
        # torch RMSNorm creates float32 weights), so the mixed-precision optimizer keeps one fp32 main copy each
        gpt.to(config.params_dtype)
    if torch.cuda.is_available():
        # built on the CPU (use_cpu_initialization: the same initial weights in every TP/PP layout), then moved to
        # this rank's GPU, as Megatron-LM's get_model does
        gpt.cuda(torch.cuda.current_device())
        for module in gpt.modules():  # RoPE's inverse frequencies are a plain attribute, not a buffer
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                module.inv_freq = module.inv_freq.cuda(torch.cuda.current_device())
    return gpt


def frozen_expert_bias(gpt) -> None:
    """Make each router's score-correction bias (``model.moe.expert_bias``; a buffer in megatron-core) a parameter
    that takes no gradient, so it travels with the weights wherever they go (full state, HF export, checkpoints,
    the rollout engine's weight sync) while no optimizer updates it; megatron's router reads it as before."""
    for module in gpt.modules():
        bias = module._buffers.get("expert_bias")
        if bias is not None:
            del module._buffers["expert_bias"]
            module.expert_bias = torch.nn.Parameter(bias, requires_grad=False)


def _mark_sinks_sharded(gpt) -> None:
    """The attention sinks (megatron's learnable softmax offset, one per head) are split over the TP ranks with the
    heads; megatron-core does not mark them, so the full-state and checkpoint code would take them as replicated."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for module in gpt.modules():
        offset = getattr(module, "softmax_offset", None)
        if isinstance(offset, torch.nn.Parameter) and not getattr(offset, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(offset, True, 0, 1)


def _expert_outputs_out_of_place(gpt) -> None:
    """Megatron-core's expert MLP adds its output bias to linear_fc2's output in place (``output += bias * prob``);
    with one expert-tensor-parallel rank that output is the input of an identity autograd function, which torch
    refuses to modify in training. Each expert's linear_fc2 hands back a copy instead (same values)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    def copying(forward):
        def wrapper(*args, **kwargs):
            output, bias = forward(*args, **kwargs)
            return (output.clone() if torch.is_grad_enabled() else output), bias

        return wrapper

    for module in gpt.modules():
        if isinstance(module, SequentialMLP):
            for expert in module.local_experts:
                expert.linear_fc2.forward = copying(expert.linear_fc2.forward)


def build_model_chunks(model: ModelConfig, parallel: ParallelConfig) -> list:
    """All model chunks held by this rank: one, or ``virtual_pipeline`` for interleaved schedules."""
    if parallel.virtual_pipeline is None:
        return [build_gpt_model(model, parallel)]
    return [build_gpt_model(model, parallel, vp_stage=i) for i in range(parallel.virtual_pipeline)]


@dataclass
class PolicyAndReference:
    policy: list  # model chunks, trainable
    reference: list  # model chunks, frozen


def freeze(chunks: list) -> list:
    """Make chunks a frozen reference: eval mode, no parameter requires grad."""
    for chunk in chunks:
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)
    return chunks


def build_policy_and_reference(model: ModelConfig, parallel: ParallelConfig) -> PolicyAndReference:
    """Policy and reference with the same layout; the reference starts as a copy of the policy. With
    ``model.moe.routing_replay=rollout`` the policy's routers replay the rollout's experts; the reference's route
    by themselves (models/routing_replay.py says why)."""
    policy = build_model_chunks(model, parallel)
    reference = build_model_chunks(model, parallel)
    for ref_chunk, pol_chunk in zip(reference, policy):
        ref_chunk.load_state_dict(pol_chunk.state_dict())
    if model.moe.enabled and model.moe.routing_replay == "rollout":
        attach_replay(policy)
    return PolicyAndReference(policy=policy, reference=freeze(reference))
