"""Config sections of the rollout: ``rollout.sampling`` and the serving engines' ``rollout.sglang`` and
``rollout.vllm``.

Plain dataclasses with no serving (and no torch) imports, so a config can be loaded on a machine without SGLang
or vLLM, and a config error is reported before any model code is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_kl.config import ConfigError
from megatron_kl.constraints import check_declared, checked
from megatron_kl.vocab_parallel.config import Truncation

WEIGHT_SYNC = ("from_disk", "from_tensor", "from_distributed")
QUANTIZATIONS = ("none", "fp8")
DELTA_LOADER = "megatron_kl.rollout.sglang_loader.sglang_delta_loader"  # the servers' --custom-weight-loader for delta syncs  # rollout.quantization: the weights the engines sample with (rollout/quantization.py)
VLLM_MODES = ("llm", "server")
VLLM_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang servers: connect to ``urls`` (servers or one sglang-router), or start ``num_servers`` of them.

    Weight sync (``weight_sync``): from_disk writes an HF checkpoint under ``sync_dir`` (a filesystem the
    servers can read) and calls /update_weights_from_disk; from_tensor hands CPU tensors to colocated
    servers through /update_weights_from_tensor; from_distributed broadcasts from trainer rank 0 over an
    NCCL group set up with /init_weights_update_group.
    """

    urls: list[str] = checked(resumable=True, default_factory=list)  # empty: launch managed servers
    model_path: Optional[str] = checked(
        None, free=True
    )  # HF directory the servers start from; default init.hf_checkpoint
    host: str = checked("127.0.0.1", resumable=True, free=True, nonempty=True)
    port: int = checked(
        30000, resumable=True, ge=1, le=65535
    )  # first managed server's port; the others count up, skipping ports in use
    num_servers: int = checked(1, ge=1)
    tp_size: int = checked(1, ge=1)
    dp_size: int = checked(1, ge=1)
    mem_fraction_static: float = checked(0.85, gt=0, lt=1)
    enable_memory_saver: bool = False  # needed for release/resume_memory_occupation when colocated
    colocated: bool = False  # release the servers' memory while the trainer runs
    extra_args: list[str] = field(default_factory=list)  # more sglang.launch_server flags
    weight_sync: str = checked("from_disk", choices=WEIGHT_SYNC)
    sync_dir: Optional[str] = checked(
        None, resumable=True, free=True
    )  # from_disk: shared with the servers; default <train.output_dir>/weight_sync
    server_module: str = checked(
        "sglang.launch_server", free=True, nonempty=True
    )  # tests: megatron_kl.testing.sglang_server (no SGLang needed)
    max_concurrency: int = checked(64, resumable=True, ge=1)  # in-flight /generate requests per engine
    # top-p without top-k: top log-probs per position asked for to rebuild the truncated distribution's log-probs
    # (SGLang returns those of the full tempered softmax); a support larger than this is an error naming it
    top_logprobs_num: int = checked(256, ge=1)
    request_timeout_s: float = checked(
        300.0, resumable=True, ge=0.1
    )  # total per attempt; every attempt + backoff < parallel.distributed_timeout_s
    max_retries: int = checked(
        4, resumable=True, ge=0
    )  # per request, on 5xx / 429 / timeouts / dropped or cut-short answers / corrupt values
    backoff_s: float = checked(0.5, resumable=True, ge=0)  # first retry delay, doubled each retry
    startup_timeout_s: float = checked(900.0, resumable=True, ge=0.1)  # /health of a starting server
    restart_dead_servers: bool = checked(True, resumable=True)  # managed servers only
    # the servers' --api-key comes from this environment variable (the launcher's disaggregated job sets a
    # per-job key there); managed servers get a fresh random key when it is unset
    api_key_env: str = checked("MEGATRON_KL_SGLANG_API_KEY", resumable=True, free=True, nonempty=True)

    def __post_init__(self):
        if any(str(a) == "--api-key" or str(a).startswith("--api-key=") for a in self.extra_args):
            raise ConfigError(
                f"rollout.sglang.extra_args passes --api-key: the trainer gives its servers their key "
                f"itself, read from the environment variable rollout.sglang.api_key_env names (now "
                f"{self.api_key_env}), so the key is in no command line, config or log; export the key "
                "there and drop --api-key from extra_args"
            )
        check_declared(self, "rollout.sglang.")
        if not isinstance(self.urls, list) or not all(isinstance(u, str) and u.startswith("http") for u in self.urls):
            raise ConfigError(f"rollout.sglang.urls={self.urls!r} must be a list of http(s):// addresses")
        if self.colocated and not self.enable_memory_saver:
            raise ConfigError(
                "rollout.sglang.colocated=true needs rollout.sglang.enable_memory_saver=true "
                "(SGLang releases memory only with --enable-memory-saver)"
            )


@dataclass(frozen=True)
class VLLMConfig:
    """vLLM: ``mode: llm`` runs vllm.LLM in the trainer process; ``mode: server`` talks to an OpenAI server."""

    mode: str = checked("llm", choices=VLLM_MODES)
    url: Optional[str] = checked(None, resumable=True, free=True)  # server mode
    model_path: Optional[str] = checked(None, free=True)  # default: init.hf_checkpoint
    tensor_parallel_size: int = checked(1, ge=1)
    gpu_memory_utilization: float = checked(0.5, gt=0, le=1)
    dtype: str = checked("auto", choices=VLLM_DTYPES)
    max_model_len: Optional[int] = checked(None, ge=1)
    enable_sleep_mode: bool = False  # colocated: sleep while the trainer runs
    sync_dir: Optional[str] = checked(None, resumable=True, free=True)  # default <train.output_dir>/weight_sync
    request_timeout_s: float = checked(300.0, resumable=True, ge=0.1)  # total per attempt (see rollout.sglang)
    max_retries: int = checked(4, resumable=True, ge=0)
    backoff_s: float = checked(0.5, resumable=True, ge=0)
    # mode=server: the --logprobs-mode the server was started with (vLLM's default raw_logprobs are the full
    # softmax's; top-k / top-p sampling needs processed_logprobs, the truncated distribution's). mode=llm sets it.
    server_logprobs_mode: str = checked("raw_logprobs", choices=VLLM_LOGPROBS_MODES)

    def __post_init__(self):
        check_declared(self, "rollout.vllm.")
        if self.mode == "server" and not self.url:
            raise ConfigError("rollout.vllm.mode=server needs rollout.vllm.url (http://host:port)")


DISTRIBUTIONS = ("truncated", "full")  # rollout.sampling.distribution: what the trainer differentiates


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = checked(1.0, ge=0)  # 0 means greedy
    top_p: float = checked(1.0, gt=0, le=1)
    top_k: int = checked(0, ge=0)  # 0 disables
    max_new_tokens: int = checked(16, ge=1)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = checked(0, ge=0)
    # the policy distribution the trainer computes log-probs, entropy and KL of: truncated (the engines'
    # sampling distribution: on-policy) | full (softmax(logits / T) over the whole vocabulary: off-policy and
    # biased whenever top_k / top_p truncate; kept to reproduce other libraries)
    distribution: str = checked("truncated", choices=DISTRIBUTIONS)
    # fraction of sampled response tokens allowed outside the trainer's truncated support at the weights that
    # sampled them (an engine's logits differ from the trainer's by rounding at the cut); above it: an error
    support_tolerance: float = checked(0.001, ge=0, le=1)

    def __post_init__(self):
        check_declared(self, "rollout.sampling.")

    @property
    def truncation(self) -> Truncation:
        """The engines' support rule (may be inactive)."""
        return Truncation(top_k=self.top_k, top_p=self.top_p)

    def truncates(self, vocab_size: Optional[int] = None) -> bool:
        """Whether sampling uses a strict subset of the vocabulary (greedy decoding aside)."""
        return self.temperature > 0 and self.truncation.active(vocab_size)

    def trained_truncation(self, vocab_size: Optional[int] = None) -> Optional[Truncation]:
        """The truncation the trainer applies to the policy: the engines' rule with distribution=truncated."""
        if self.distribution == "truncated" and self.truncates(vocab_size):
            return self.truncation
        return None

    @property
    def logprob_temperature(self) -> float:
        """The temperature the behaviour log-probs (and the trainer's recomputation) use."""
        return self.temperature if self.temperature > 0 else 1.0
