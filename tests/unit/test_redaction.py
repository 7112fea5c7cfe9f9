"""The one redaction rule (megatron_kl/redaction.py): which names and flags hold secrets, and that every writer's
view - argument lists, config dicts, text, log records, the command line's streams - replaces them."""

import io
import logging

import pytest

from megatron_kl import redaction
from megatron_kl.redaction import REDACTED


@pytest.mark.parametrize(
    "name, secret",
    [
        ("api_key", True),
        ("hf_token", True),
        ("WANDB_API_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("db_password", True),
        ("apiKey", True),
        ("credentials", True),
        ("api_key_env", False),
        ("token_env", False),
        ("TOKENIZERS_PARALLELISM", False),
        ("max_new_tokens", False),
        ("keyboard", False),
        ("monkey", False),
        ("token_dispatcher", False),
        ("key_path", False),
    ],
)
def test_secret_names(name, secret):
    assert redaction.is_secret_name(name) is secret


@pytest.mark.parametrize(
    "flag, secret",
    [
        ("--api-key", True),
        ("--admin-api-key", True),
        ("--hf-token=x", True),
        ("--password", True),
        ("--token-latency-s", False),
        ("--max-new-tokens", False),
        ("--skip-tokenizer-init", False),
        ("api-key", False),
    ],
)
def test_secret_flags(flag, secret):
    assert redaction.is_secret_flag(flag) is secret


def test_argument_lists_lose_the_values_of_secret_flags_only():
    args = ["--api-key", "k1", "--token-latency-s", "0.2", "--hf-token=k2", "--flag", "--password", "--port", "8"]
    assert redaction.secret_flag_values(args) == ["k1", "k2"]  # a flag followed by a flag has no value
    assert redaction.redact_args(args) == [
        "--api-key",
        REDACTED,
        "--token-latency-s",
        "0.2",
        f"--hf-token={REDACTED}",
        "--flag",
        "--password",
        "--port",
        "8",
    ]


def test_config_dicts_text_and_urls(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "envsecret-123")
    monkeypatch.setenv("SHORT_KEY", "1")  # too short to hide from text
    data = {
        "rollout": {"sglang": {"extra_args": ["--admin-api-key", "k1"], "api_key_env": "MY_SERVICE_TOKEN"}},
        "reward": {
            "functions": [{"kwargs": {"api_key": "k2", "note": "uses envsecret-123"}}],
            "service": {"urls": ["http://u:pw-secret@h:1/x", "http://h:2/"]},
        },
        "launch": {"env": {"HF_TOKEN": "k3", "NCCL_DEBUG": "INFO"}},
        "train": {"steps": 1},
    }
    out = redaction.redact_config(data)
    assert out["rollout"]["sglang"] == {"extra_args": ["--admin-api-key", REDACTED], "api_key_env": "MY_SERVICE_TOKEN"}
    assert out["reward"]["functions"][0]["kwargs"] == {"api_key": REDACTED, "note": f"uses {REDACTED}"}
    assert out["reward"]["service"]["urls"] == [f"http://u:{REDACTED}@h:1/x", "http://h:2/"]
    assert out["launch"]["env"] == {"HF_TOKEN": REDACTED, "NCCL_DEBUG": "INFO"} and out["train"] == {"steps": 1}
    assert data["launch"]["env"]["HF_TOKEN"] == "k3"  # a copy
    assert redaction.redact_text("1 + 1") == "1 + 1"


def test_registered_secrets_and_config_secrets_leave_log_records_and_streams():
    redaction.register_config(
        {
            "reward": {"functions": [{"kwargs": {"password": "registered-pw-1"}}]},
            "x": ["--hf-token", "registered-tok-2"],
        }
    )
    redaction.register("runtime-key-3")
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    logger = logging.getLogger("test_redaction")
    logger.addHandler(handler)
    redaction.install_log_filter(logger)
    try:
        logger.warning("a %s b %s c %s", "registered-pw-1", "registered-tok-2", "runtime-key-3")
    finally:
        logger.removeHandler(handler)
    assert buffer.getvalue() == f"a {REDACTED} b {REDACTED} c {REDACTED}\n"
    stream = io.StringIO()
    redaction.RedactingStream(stream).write("key=runtime-key-3\n")
    assert stream.getvalue() == f"key={REDACTED}\n"


def test_the_default_configs_register_no_secret():
    """No field of a shipped configuration holds a secret: nothing of its values (``auto``, say) is hidden from the
    lines a run prints."""
    from megatron_kl.config import to_dict
    from megatron_kl.train.config import load_train_config

    before = set(redaction._registered)
    try:
        redaction._registered.clear()
        redaction.register_config(to_dict(load_train_config("configs/cpu/default.yaml", ["model.moe.num_experts=4"])))
        assert redaction._registered == set()
        assert redaction.redact_text("regime='auto'") == "regime='auto'"
    finally:
        redaction._registered.clear()
        redaction._registered.update(before)
