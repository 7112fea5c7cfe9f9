"""The embedded engine: KV-cache generation agrees with the trainer's recomputation, at TP=1 and TP=2."""

import pytest
import torch

from megatron_kl.testing.distributed import run_ranks
from tests.e2e.workers import engine_worker, ragged_engine_worker

MODEL = {
    "architecture": "qwen2",
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "vocab_size": 40,
    "max_position_embeddings": 64,
}
PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 9, 9, 9, 2], [3]]


GROUPED = [p for p in PROMPTS for _ in range(3)] + [[1, 5, 6, 9]]  # GRPO groups, and a prompt sharing a prefix


@pytest.mark.parametrize("prompts", [PROMPTS, GROUPED], ids=["distinct", "grouped"])
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_engine_logprobs_equal_trainer_recompute_and_tp2_equals_tp1(temperature, prompts):
    """Also: repeated prompt prefixes are prefilled once and their KV cache copied to every row that has them;
    the generation equals prefilling every row (same tokens; log-probs to float32 rounding: the prefill GEMMs
    see fewer rows). The engine decodes in megatron's flash-decoding mode (keys rotated once and cached rotated;
    models/flash_decode.py): the same tokens and log-probs as megatron's own static decode."""
    sampling = {"temperature": temperature, "max_new_tokens": 9, "stop_token_ids": [2, 3]}
    tp1 = run_ranks(engine_worker, 1, MODEL, 1, prompts, sampling)[0]
    tp2 = run_ranks(engine_worker, 2, MODEL, 2, prompts, sampling)
    for out in [tp1] + tp2:
        assert [c.response_ids for c in out["completions"]] == [c.response_ids for c in out["every_row"]]
        _assert_same_generation(out["completions"], out["megatron_decode"], tolerance=1e-6)
        torch.testing.assert_close(
            torch.tensor(sum((c.response_logprobs for c in out["completions"]), [])),
            torch.tensor(sum((c.response_logprobs for c in out["every_row"]), [])),
            rtol=1e-6,
            atol=1e-6,
        )
        mask = out["mask"].bool()
        assert mask.sum() > len(prompts)
        diff = (out["recomputed"] - out["behavior"])[mask].abs().max()
        assert diff < 2e-5, f"KV-cache log-probs differ from the full recomputation by {diff}"
        if prompts is GROUPED and temperature > 0:  # rows of one prompt still draw their own samples
            assert len({tuple(c.response_ids) for c in out["completions"][:3]}) > 1
        for c in out["completions"]:
            assert c.weight_version == 7
            assert len(c.response_ids) <= 9
            stops = [i for i, t in enumerate(c.response_ids) if t in (2, 3)]
            assert (c.finish_reason == "stop") == bool(stops)
            assert not stops or stops == [len(c.response_ids) - 1]  # nothing after the stop token
    # both TP ranks drew the same tokens, and TP=2 drew what TP=1 drew
    ids = [[c.response_ids for c in out["completions"]] for out in [tp1] + tp2]
    assert ids[0] == ids[1] == ids[2]
    torch.testing.assert_close(tp2[0]["behavior"], tp1["behavior"], atol=2e-5, rtol=0)


def _assert_same_generation(actual, expected, tolerance: float):
    assert [c.response_ids for c in actual] == [c.response_ids for c in expected]
    assert [c.finish_reason for c in actual] == [c.finish_reason for c in expected]
    torch.testing.assert_close(
        torch.tensor(sum((c.response_logprobs for c in actual), [])),
        torch.tensor(sum((c.response_logprobs for c in expected), [])),
        rtol=tolerance,
        atol=tolerance,
    )


@pytest.mark.parametrize("tp,attention", [(1, "auto"), (2, "auto"), (1, "unfused")])
def test_bf16_flash_decoding_generates_what_megatrons_decode_generates(tp, attention):
    """A bf16 model: the engine keeps a float32 KV cache (the bf16 keys, rotated in bf16 exactly as the trainer's
    forward rotates them, stored exactly) and generates exactly what megatron's static decode generates, whose
    cache is bf16 and whose keys are rotated again at every step; and it matches the trainer's recompute to bf16
    precision. Prompts of different lengths (prompt tokens forced one step at a time) and repeated prompts. With
    megatron's own (bf16) core attention the cache stays bf16 and generation still matches the recompute."""
    sampling = {"temperature": 1.0, "max_new_tokens": 12}
    bf16 = {**MODEL, "params_dtype": "bfloat16", "core_attention": attention}
    for out in run_ranks(engine_worker, tp, bf16, tp, GROUPED, sampling):
        if attention == "unfused":  # megatron's bf16 attention kernel in the prefill: megatron's bf16 cache
            assert out["cache_dtype"] is None
        else:
            assert out["cache_dtype"] == torch.float32
            _assert_same_generation(out["completions"], out["megatron_decode"], tolerance=0.0)
        mask = out["mask"].bool()
        assert (out["recomputed"] - out["behavior"])[mask].abs().max() < 5e-2


def test_engine_sharing_the_policy_weights_generates_what_a_copy_generates():
    from tests.e2e.workers import shared_engine_worker

    sampling = {"temperature": 1.0, "max_new_tokens": 8}
    out = run_ranks(shared_engine_worker, 1, MODEL, PROMPTS, sampling)[0]
    assert out["same_storage"] and not out["copy_storage"]
    shared, copied = out["before"]
    assert shared == copied
    shared, copied = out["after_step"]
    assert shared != copied  # the sharing replica already sees the step; the copy until its sync
    assert out["after_sync"][0] == out["after_sync"][1] == shared
    assert out["followed"]


@pytest.mark.parametrize("tp", [1, 2])
def test_ragged_prompts_decode_from_the_first_step_as_each_prompt_alone(tp):
    """Prompts of lengths 1..9 in one batch: each distinct length is prefilled once, then every row decodes from
    the first step (max_new_tokens - 1 decode forwards, none spent forcing prompt tokens); greedy generation equals
    generating each prompt alone (tokens; log-probs to float32 rounding) and megatron's static scheme, which
    forces the longer prompts' tokens one forward at a time; sampled rows draw the same uniforms in both schemes."""
    prompts = [[1 + (7 * i + j) % 30 for j in range(length)] for i, length in enumerate([1, 9, 4, 4, 2, 9])]
    new = 7
    for temperature in (0.0, 0.8):
        sampling = {"temperature": temperature, "max_new_tokens": new}
        for out in run_ranks(ragged_engine_worker, tp, MODEL, tp, prompts, sampling):
            prefills = [shape for shape in out["forwards"] if shape[1] > 1]
            assert sorted(shape[1] for shape in prefills) == [2, 4, 9]  # one forward per distinct length > 1
            assert len(out["forwards"]) == 4 + new - 1  # lengths 1, 2, 4, 9, then the decode steps
            if temperature == 0.0:
                _assert_same_generation(out["together"], out["alone"], tolerance=1e-5)
            _assert_same_generation(out["together"], out["forcing"], tolerance=1e-5)
            assert all(len(c.response_ids) == new for c in out["together"])


MLA_MODEL = {
    "architecture": "deepseek_v3",
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 96,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "vocab_size": 40,
    "max_position_embeddings": 64,
    "mla": {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12},
    "moe": {
        "num_experts": 8,
        "router_topk": 4,
        "ffn_hidden_size": 32,
        "score_function": "sigmoid",
        "expert_bias": True,
        "num_groups": 4,
        "group_topk": 2,
        "routed_scaling_factor": 2.5,
        "first_dense_layers": 1,
    },
}


GPT_OSS_MODEL = {
    "architecture": "gpt_oss",
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "vocab_size": 40,
    "max_position_embeddings": 64,
    "attention_sinks": True,
    "sliding_window": 3,
    "full_attention_every": 2,
    "linear_bias": True,
    "glu_activation": "quick_gelu",
    "glu_up_offset": 1.0,
    "glu_clamp": 1.0,
    "yarn": {"factor": 8.0, "original_max_position_embeddings": 16, "truncate": False},
    "moe": {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32},
}


@pytest.mark.parametrize(
    "model,tp",
    [(MLA_MODEL, 1), (MLA_MODEL, 2), (GPT_OSS_MODEL, 1)],
    ids=["deepseek_v3-tp1", "deepseek_v3-tp2", "gpt_oss-tp1"],
)
def test_static_decoding_families_generate_what_the_trainer_recomputes(model, tp):
    """DeepSeek-V3's attention applies RoPE inside itself at one offset for all rows (rows at their own positions
    were up to 1.5 nats off), and megatron's flash decoding has no YaRN, attention sinks or sliding windows (GPT-OSS;
    responses run past the window of 3): the engine decodes both in megatron's static scheme, and prompts of
    different lengths give the trainer's log-probs."""
    sampling = {"temperature": 0.7, "max_new_tokens": 9}
    for out in run_ranks(engine_worker, tp, model, tp, PROMPTS, sampling):
        mask = out["mask"].bool()
        assert mask.sum() > len(PROMPTS)
        assert (out["recomputed"] - out["behavior"])[mask].abs().max() < 2e-5
        _assert_same_generation(out["completions"], out["megatron_decode"], tolerance=1e-6)
