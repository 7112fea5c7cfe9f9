"""Tiny random HF models of each family and the rank function of the conversion tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_kl.config import ParallelConfig

FAMILIES = {
    # Llama-3.2 style: GQA, llama3 RoPE scaling (factor 32), tied embeddings
    "llama": dict(
        model_type="llama",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # Qwen2.5 style: qkv bias, untied, saved in bfloat16
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        dtype="bfloat16",
    ),
    # Qwen3 style: q/k RMSNorm, head_dim != hidden / heads, tied
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
}
MOE_FAMILIES = {
    # Qwen3-MoE style: 8 experts, top-2 renormalised (norm_topk_prob), q/k RMSNorm, no shared expert
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # Qwen2-MoE style: top-4 of 8 not renormalised, a shared expert behind a sigmoid gate, qkv bias
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # DeepSeek-V3 style: multi-latent attention with a query LoRA, interleaved rotary dims, YaRN with mscale_all_dim,
    # one dense layer first, a shared expert, the sigmoid router with its score-correction bias, top-4 of 8 limited
    # to the best 2 of 4 groups, routed scaling factor
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=512,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "rope_theta": 10000.0,
        },
    ),
    # DeepSeek-V2-Lite style attention: no query LoRA, rotary dims stored as halves (rope_interleave false), plain
    # RoPE; every group kept, two shared experts, every layer sparse, tied embeddings, saved in bfloat16
    "deepseek_v3_plain": dict(
        model_type="deepseek_v3",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=0,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        max_position_embeddings=512,
        rope_interleave=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="bfloat16",
    ),
    # GPT-OSS style: attention sinks, sliding (window 4 < the 12 tokens) and full layers alternating, q/k/v/o biases,
    # YaRN without truncation, 4 experts stored fused with biases, the clamped GLU (limit 1: clamping often), the
    # router with its bias
    "gpt_oss": dict(
        model_type="gpt_oss",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=1.0,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
        },
    ),
    # a full-attention layer every third, plain RoPE, top-2 of 4, saved in bfloat16
    "gpt_oss_every3": dict(
        model_type="gpt_oss",
        vocab_size=61,
        hidden_size=64,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=3,
        swiglu_limit=7.0,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        dtype="bfloat16",
    ),
}


def make_hf_model(family: str, directory: Path, seed: int = 0) -> Path:
    """Build a random HF model with transformers' config class, save it (safetensors) plus tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict({**FAMILIES, **MOE_FAMILIES}[family])
    dtype = spec.pop("dtype", "float32")
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # weights large enough that the logits are far from uniform
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # DeepSeek-V3's score-correction bias decides the top-k
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return directory


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def convert_worker(rank, world, hf_dir: str, parallel_cfg: ParallelConfig, tokens, export_dir):
    """Load the HF checkpoint into a Megatron GPTModel in the given layout; return the gathered logits
    (last stage) and, with ``export_dir``, export it back to HF from this layout."""
    from megatron_kl.models import builder, hf, parallel, pipeline
    from megatron_kl.validation.model_workers import _gather_logits

    checkpoint = hf.HFCheckpoint(hf_dir)
    model_cfg = checkpoint.model_config(make_vocab_size_divisible_by=16)
    torch.manual_seed(0)
    parallel.initialize(model_cfg, parallel_cfg, seed=1)
    chunks = builder.build_model_chunks(model_cfg, parallel_cfg)
    hf.load_hf_into(chunks, checkpoint, model_cfg, parallel.tp_group())
    batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=torch.ones(tokens.shape[0], tokens.shape[1] - 1))
    vocab = pipeline.VocabOptions(vocab_size=model_cfg.vocab_size, fused=False)
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        outs = pipeline.run_schedule(chunks, batch, 2, _gather_logits(model_cfg), vocab, forward_only=True)
    logits = torch.cat([o["logits"] for o in sorted(outs, key=lambda o: o["index"])]) if outs else None
    if export_dir is not None:
        hf.export_hf(
            chunks,
            model_cfg,
            export_dir,
            dtype=checkpoint.dtype,
            tp_group=parallel.tp_group(),
            pp_group=parallel.pp_group(),
            source_dir=hf_dir,
            max_shard_bytes=40_000,
        )
    dist.barrier()
    return {"logits": logits}
