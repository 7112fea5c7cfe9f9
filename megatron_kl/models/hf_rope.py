"""HF RoPE parameters (``rope_parameters`` or ``rope_scaling``) as ``model.yarn``, for the families that scale RoPE with
YaRN (DeepSeek-V3, GPT-OSS)."""

from __future__ import annotations

from megatron_kl.config import ConfigError
from megatron_kl.model_variants import YarnConfig


def yarn_from_hf(rope: dict, max_positions: int, family: str) -> YarnConfig:
    """``model.yarn`` of HF rope parameters (rope_type default: none). HF's attention factor is mscale(f, mscale) /
    mscale(f, mscale_all_dim) when both are set, else mscale(f, 1): megatron-core's formula with (mscale, 0) there;
    without a factor HF takes max_position_embeddings / original_max_position_embeddings."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return YarnConfig()
    if rope_type != "yarn":
        raise ConfigError(f"config.json rope_type={rope_type!r}: {family} is converted with default or yarn RoPE")
    if rope.get("attention_factor") is not None:
        raise ConfigError(
            "config.json rope attention_factor is set: megatron-core's YaRN derives it from factor, "
            "mscale and mscale_all_dim; remove it if it is their value"
        )
    original = int(rope["original_max_position_embeddings"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    return YarnConfig(
        factor=float(rope.get("factor") or max_positions / original),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
        truncate=bool(rope.get("truncate", True)),
    )


def yarn_to_hf(yarn: YarnConfig, rope_theta: float) -> dict:
    """The HF rope parameters of ``model.yarn`` (what :func:`yarn_from_hf` reads back)."""
    return {
        "rope_type": "yarn",
        "rope_theta": rope_theta,
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "mscale": yarn.mscale,
        "mscale_all_dim": yarn.mscale_all_dim,
        "truncate": yarn.truncate,
    }
