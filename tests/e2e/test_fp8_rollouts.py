"""FP8 rollouts: the embedded engine samples with block-wise FP8 weights (TP=1 and TP=2) while the trainer keeps its
own; the SGLang test server started with --quantization fp8 does the same, and a given server that does not is
refused."""

from __future__ import annotations

import pytest

from megatron_kl.rollout.engine import SamplingConfig
from megatron_kl.testing.distributed import run_ranks
from tests.e2e.test_engine import MODEL, PROMPTS
from tests.e2e.workers import fp8_engine_worker


@pytest.mark.parametrize("tp", [1, 2])
def test_the_engine_samples_the_fp8_policy_and_the_trainer_keeps_its_weights(tp):
    """Behaviour log-probs equal the trainer's recomputation with the policy quantized block-wise (< 2e-5, the KV
    cache's float32 rounding) and differ from the policy's own by far more: the gap the mismatch metrics report. An
    engine asked to share the policy's tensors holds a copy instead (quantizing must not touch the trainer's
    weights)."""
    sampling = {"temperature": 0.7, "max_new_tokens": 9, "stop_token_ids": [2, 3]}
    for out in run_ranks(fp8_engine_worker, tp, MODEL, tp, PROMPTS, sampling):
        mask = out["mask"].bool()
        to_fp8 = (out["behavior"] - out["quantized"])[mask].abs().max()
        to_own = (out["behavior"] - out["own"])[mask].abs().mean()
        assert to_fp8 < 2e-5, to_fp8
        assert to_own > 100 * max(float(to_fp8), 1e-7), (to_own, to_fp8)
        assert not out["shares_memory"]


def test_sglang_fp8_servers_quantize_and_a_plain_server_is_refused_for_an_fp8_run(tmp_path, monkeypatch):
    from hf_workers import make_hf_model

    from megatron_kl.rollout.config import SGLangConfig
    from megatron_kl.rollout.sglang import SGLangEngine
    from megatron_kl.rollout.sglang_sync import FromTensor
    from tests.e2e.test_sglang import PROMPTS as SERVED_PROMPTS
    from tests.e2e.test_sglang import TEST_SERVER, _engine, _hf_tensors

    model_dir = make_hf_model("qwen2", tmp_path / "a", seed=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=[0])
    plain = _engine(tmp_path / "plain", model_dir)
    fp8 = _engine(tmp_path / "fp8", model_dir, "--quantization", "fp8")
    try:
        for engine in (plain, fp8):
            engine.update_weights(_hf_tensors(model_dir), 1)
        want, got = plain.generate(SERVED_PROMPTS, sampling, seed=4), fp8.generate(SERVED_PROMPTS, sampling, seed=4)
        shared = [(a, b) for a, b in zip(want, got) if a.response_ids == b.response_ids]
        assert shared, "no response drew the same tokens"
        gap = max(abs(x - y) for a, b in shared for x, y in zip(a.response_logprobs, b.response_logprobs))
        assert gap > 1e-3, gap  # the FP8 weights' log-probs, not the model's
        config = SGLangConfig(urls=[plain.urls[0]], server_module=TEST_SERVER, startup_timeout_s=30)
        monkeypatch.setenv(config.api_key_env, plain.api_key)  # given servers: the key comes from the environment
        with pytest.raises(ValueError, match="serves quantization=None but rollout.quantization=fp8"):
            SGLangEngine(config, FromTensor(config), quantization="fp8")
        monkeypatch.setenv(config.api_key_env, fp8.api_key)
        SGLangEngine(SGLangConfig(urls=[fp8.urls[0]], startup_timeout_s=30), FromTensor(config), quantization="fp8")
    finally:
        plain.shutdown()
        fp8.shutdown()
