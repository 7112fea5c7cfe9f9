"""Build the policy and the reference as megatron.core GPTModel instances.

The layer spec is Transformer Engine's when ``transformer_engine`` imports (GPU clusters) and the
pure-PyTorch local spec otherwise. Weights are initialised on the CPU from a full master tensor and then
sliced (``use_cpu_initialization``), so any TP layout starts from the same weights as TP=1.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_kl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_kl.models.norm import use_lean_rms_norm
from megatron_kl.models.context_parallel import check_runnable

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(model: ModelConfig, parallel: ParallelConfig, flash_decode: bool = False):
    """Megatron's TransformerConfig for ``model``; ``flash_decode``: megatron's flash-decoding inference mode
    (RoPE applied once per new token, rotated keys cached; models/flash_decode.py), for the rollout engine."""
    from megatron.core.transformer import TransformerConfig

    model = model.resolved()
    dtype = _DTYPES[model.params_dtype]
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
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
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if model.recompute == "full" else {}),
        **moe_transformer_fields(model, parallel),
    )


def moe_dispatcher(setting: str) -> str:
    """``model.moe.token_dispatcher`` resolved: megatron's alltoall dispatcher creates CUDA streams."""
    if setting == "auto":
        return "alltoall" if torch.cuda.is_available() else "allgather"
    if setting == "alltoall" and not torch.cuda.is_available():
        raise ConfigError("model.moe.token_dispatcher=alltoall needs CUDA (megatron's alltoall dispatcher uses CUDA "
                          "streams); use allgather or auto on the CPU")
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
        moe_router_score_function="softmax",
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
        fields.update(moe_expert_capacity_factor=moe.capacity_factor, moe_token_drop_policy="probs",
                      moe_pad_expert_input_to_capacity=False)
    if moe.shared_expert_ffn_hidden_size:
        fields.update(moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=True)
    return fields


def _local_kernel(setting: str, kernel: str, model: ModelConfig) -> bool:
    """Whether a pure-PyTorch-spec kernel option (``model.core_attention``, ``model.rms_norm``) picks ``kernel``:
    set to it, or ``auto`` with 16-bit parameters (float32 keeps megatron's and torch's modules)."""
    return setting == kernel or (setting == "auto" and model.params_dtype != "float32")


def layer_spec(model: ModelConfig):
    """Transformer Engine spec where TE imports, Megatron's pure-PyTorch spec otherwise (its core attention
    by torch's SDPA or megatron's DotProductAttention: ``model.core_attention``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    model = model.resolved()
    experts = model.moe.num_experts or None
    if have_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                                          qk_layernorm=model.qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                    qk_layernorm=model.qk_layernorm, normalization="RMSNorm")
    if _local_kernel(model.core_attention, "sdpa", model):
        from megatron_kl.models.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_gpt_model(model: ModelConfig, parallel: ParallelConfig, vp_stage: Optional[int] = None,
                    pg_collection=None, flash_decode: bool = False, whole: bool = False,
                    stage: Optional[tuple[bool, bool]] = None):
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
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(resolved),
        vocab_size=resolved.padded_vocab_size(parallel.tensor_parallel),
        max_sequence_length=resolved.max_position_embeddings,
        pre_process=whole or (stage[0] if stage is not None else
                              parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)),
        post_process=whole or (stage[1] if stage is not None else
                               parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)),
        parallel_output=True,
        share_embeddings_and_output_weights=resolved.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(resolved.rope_theta),
        rope_scaling=resolved.rope_scaling_factor is not None,
        rope_scaling_factor=resolved.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
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
        from megatron_kl.models.routing_replay import attach_replay

        attach_replay(policy)
    return PolicyAndReference(policy=policy, reference=freeze(reference))
