"""Configuration of the model variants beyond the dense Llama / Qwen block: mixture-of-experts MLPs and their
routers (``model.moe``), multi-latent attention (``model.mla``: DeepSeek-V2/V3) and YaRN RoPE scaling
(``model.yarn``). ``model.architecture`` says which family uses which (``megatron_kl.config.MODEL_FAMILIES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_kl.constraints import ConfigError, checked

MOE_DISPATCHERS = ("auto", "allgather", "alltoall")
ROUTING_REPLAY = ("off", "rollout")
ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-latent attention (``model.architecture: deepseek_v3``; megatron-core's MLASelfAttention).

    Per token x: the query q = W_qb RMSNorm(W_qa x) (low rank ``q_lora_rank``; null: q = W_q x), the shared latent
    c = RMSNorm(W_kva x)[:kv_lora_rank] and one RoPE key k_rope = W_kva x [kv_lora_rank:] shared by every head;
    per head h the key is [W_kvb,k c ; k_rope] (``qk_nope_head_dim`` + ``qk_rope_head_dim`` dims) and the value
    W_kvb,v c (``v_head_dim``). Scores use 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (times YaRN's mscale^2)."""

    q_lora_rank: Optional[int] = checked(None, ge=1)  # null: the query projected from x directly
    kv_lora_rank: int = checked(32, ge=1)
    qk_nope_head_dim: int = checked(16, ge=1)
    qk_rope_head_dim: int = checked(8, ge=2)
    v_head_dim: int = checked(16, ge=1)
    # how the HF checkpoint stores each head's rotary dims: interleaved pairs (DeepSeek's own, what megatron's MLA
    # reads) or halves (rope_interleave=false: permuted at conversion, models/hf_deepseek.py); compute is the same
    rope_interleave: bool = True

    @property
    def query_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (HF ``rope_type: yarn``; DeepSeek-V3, GPT-OSS): frequencies below the band set by ``beta_fast`` /
    ``beta_slow`` interpolated by ``factor``, cos/sin scaled by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) with mscale(s, m) = 0.1 m ln s + 1. ``factor: null`` turns it off."""

    factor: Optional[float] = checked(None, gt=1)
    original_max_position_embeddings: int = checked(4096, ge=1)
    beta_fast: float = checked(32.0, gt=0)
    beta_slow: float = checked(1.0, gt=0)
    mscale: float = checked(1.0, ge=0)
    mscale_all_dim: float = checked(0.0, ge=0)
    truncate: bool = True  # the correction range's bounds rounded to whole dimensions (HF truncate)

    @property
    def enabled(self) -> bool:
        return self.factor is not None


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (Qwen3-MoE; Qwen2-MoE with its shared expert): every layer's MLP is a top-k router
    over ``num_experts`` SwiGLU experts (megatron-core's MoELayer). ``num_experts: 0`` is the dense model.

    Router as in the HF models: p = softmax(router logits) over all experts, the top ``router_topk`` kept, and
    with ``normalize_topk`` (Qwen3-MoE's norm_topk_prob) renormalised to sum to 1 (megatron: softmax over the
    top-k logits); without it the kept probabilities are used as they are (Qwen2-MoE)."""

    num_experts: int = checked(0, ge=0)
    router_topk: int = checked(2, ge=1)
    ffn_hidden_size: Optional[int] = checked(
        None, ge=1
    )  # per expert (HF moe_intermediate_size); default model.ffn_hidden_size
    # the shared expert every token also goes through (0: none), scaled by sigmoid(gate . x) with
    # shared_expert_gate (Qwen2-MoE), added as it is without (DeepSeek-V3)
    shared_expert_ffn_hidden_size: int = checked(0, ge=0)
    shared_expert_gate: bool = True
    normalize_topk: bool = True
    # router scores: softmax over the experts (Qwen) or sigmoid per expert (DeepSeek-V3: the kept scores are
    # renormalised to sum to 1, which normalize_topk must then say)
    score_function: str = checked("softmax", choices=ROUTER_SCORES)
    # DeepSeek-V3's score-correction bias b (HF e_score_correction_bias): the top-k is chosen by score + b, the
    # weights are the scores themselves; loaded from the checkpoint and kept fixed in training
    expert_bias: bool = False
    # group-limited routing (DeepSeek-V3 n_group / topk_group): experts in num_groups equal groups, each group
    # scored by the sum of its top router_topk / group_topk scores, the top-k chosen in the best group_topk groups
    num_groups: Optional[int] = checked(None, ge=1)
    group_topk: Optional[int] = checked(None, ge=1)
    # the routed experts' weights multiplied by this (DeepSeek-V3 routed_scaling_factor); null: 1
    routed_scaling_factor: Optional[float] = checked(None, gt=0)
    # the first layers with a dense MLP of width model.ffn_hidden_size (DeepSeek-V3 first_k_dense_replace)
    first_dense_layers: int = checked(0, ge=0)
    # load-balancing auxiliary loss (megatron's Switch-style aux_loss, per layer, added to the training
    # gradient) and the router z-loss; 0 turns each off
    aux_loss_coeff: float = checked(0.0, ge=0)
    z_loss_coeff: float = checked(0.0, ge=0)
    # tokens an expert takes per step, as a multiple of its even share; null: dropless (no token dropped)
    capacity_factor: Optional[float] = checked(None, gt=0)
    # megatron's token dispatcher: alltoall (GPU; it needs CUDA streams), allgather (also on the CPU); auto
    # picks alltoall with CUDA, allgather without
    token_dispatcher: str = checked("auto", choices=MOE_DISPATCHERS)
    # which experts the policy's forwards in the trainer (pi_old and the update) send rollout tokens to: "off"
    # routes them anew; "rollout" replays the experts the engine chose (megatron-core's RouterReplay; the engine
    # must report its routing: rollout.engine local or sglang). The reference always routes itself
    routing_replay: str = checked("off", choices=ROUTING_REPLAY)

    def __post_init__(self):
        if str(self.routing_replay).lower() in ("false", "off"):  # YAML 1.1 reads a bare `off` as false
            object.__setattr__(self, "routing_replay", "off")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


def validate_moe(moe: MoEConfig) -> None:
    if moe.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be >= 0 (0: a dense model)")
    if moe.token_dispatcher not in MOE_DISPATCHERS:
        raise ConfigError(f"model.moe.token_dispatcher={moe.token_dispatcher!r}: use one of {list(MOE_DISPATCHERS)}")
    if moe.routing_replay not in ROUTING_REPLAY:
        raise ConfigError(f"model.moe.routing_replay={moe.routing_replay!r}: use one of {list(ROUTING_REPLAY)}")
    if not moe.enabled:
        if moe.routing_replay != "off":
            raise ConfigError(
                "model.moe.routing_replay=rollout needs a mixture-of-experts model: set "
                "model.moe.num_experts > 0, or routing_replay to off"
            )
        return
    if not 1 <= moe.router_topk <= moe.num_experts:
        raise ConfigError(
            f"model.moe.router_topk={moe.router_topk} must be in [1, model.moe.num_experts={moe.num_experts}]"
        )
    if moe.ffn_hidden_size is not None and moe.ffn_hidden_size <= 0:
        raise ConfigError(
            f"model.moe.ffn_hidden_size={moe.ffn_hidden_size} must be > 0 (or null: model.ffn_hidden_size)"
        )
    if moe.shared_expert_ffn_hidden_size < 0:
        raise ConfigError(f"model.moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size} must be >= 0")
    for name in ("aux_loss_coeff", "z_loss_coeff"):
        if not getattr(moe, name) >= 0.0:
            raise ConfigError(f"model.moe.{name}={getattr(moe, name)} must be >= 0")
    if moe.capacity_factor is not None and not moe.capacity_factor > 0.0:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor} must be > 0 (or null: dropless)")
    if moe.router_topk == 1 and moe.normalize_topk and moe.score_function == "softmax":
        raise ConfigError(
            "model.moe.router_topk=1 with normalize_topk=true: the one kept expert would weigh 1, which "
            "megatron-core's router refuses to build; set normalize_topk=false (softmax over all experts)"
            " or router_topk >= 2"
        )
    _validate_router(moe)


def _validate_router(moe: MoEConfig) -> None:
    """The router variants megatron-core builds: sigmoid scores renormalised, the bias with sigmoid scores,
    groups that split the experts evenly."""
    if moe.score_function not in ROUTER_SCORES:
        raise ConfigError(f"model.moe.score_function={moe.score_function!r}: use one of {list(ROUTER_SCORES)}")
    if moe.score_function == "sigmoid" and moe.router_topk > 1 and not moe.normalize_topk:
        raise ConfigError(
            "model.moe.score_function=sigmoid renormalises the kept scores to sum to 1 (megatron-core's "
            "sigmoid router does): set model.moe.normalize_topk=true"
        )
    if moe.expert_bias and moe.score_function != "sigmoid":
        raise ConfigError(
            "model.moe.expert_bias=true corrects sigmoid scores (DeepSeek-V3): set "
            "model.moe.score_function=sigmoid, or expert_bias=false"
        )
    if (moe.num_groups is None) != (moe.group_topk is None):
        raise ConfigError(
            f"model.moe.num_groups={moe.num_groups} and model.moe.group_topk={moe.group_topk}: "
            "group-limited routing needs both (or neither)"
        )
    if moe.num_groups is None:
        return
    if moe.num_experts % moe.num_groups:
        raise ConfigError(f"model.moe.num_groups={moe.num_groups} must divide model.moe.num_experts={moe.num_experts}")
    if moe.group_topk > moe.num_groups or moe.router_topk % moe.group_topk:
        raise ConfigError(
            f"model.moe.group_topk={moe.group_topk} must be at most model.moe.num_groups="
            f"{moe.num_groups} and divide model.moe.router_topk={moe.router_topk}"
        )
    if moe.router_topk > moe.group_topk * moe.num_experts // moe.num_groups:
        raise ConfigError(
            f"model.moe.router_topk={moe.router_topk} exceeds the experts of the model.moe.group_topk="
            f"{moe.group_topk} groups chosen; raise group_topk"
        )
