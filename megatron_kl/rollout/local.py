"""The embedded rollout engine: batched sampling from a Megatron GPTModel replica with a KV cache.

The engine keeps its own copy of the policy weights in the policy's tensor-parallel layout (each rank
holds its own shards, so a weight sync is a local copy, no communication) and its own TP process
group, so generation can run in a background thread while the trainer trains (async mode) without
the two interleaving collectives on one group. Logits are gathered over TP (``runtime_gather_output``)
and every TP rank draws the same tokens from identically seeded generators.

KV cache: megatron-core's ``StaticInferenceContext``. Prompts of different lengths share one buffer. Megatron's
static text-generation scheme prefills the shortest prompt and then feeds one position per forward, forcing prompt
tokens for rows whose prompt is longer: max - min prompt length extra forwards of the whole batch. With the
flash-decoding kernels of models/flash_decode.py the engine instead prefills every prompt whole (one forward per
distinct length) and decodes every row from the first step, row i at its own position (``ragged_rows``): the
same tokens and log-probs as each prompt alone (tested); 135M bf16, 32 rows, prompts of 20-120 tokens, 32 new
tokens: 7.90 -> 3.00 s (tools/bench_rollout.py, README). It takes whichever needs fewer forwards (distinct lengths - 1 vs max - min). The prefill runs once
per distinct prefix and its cache is copied to the rows that share it (a GRPO group's samples; SGLang's radix
cache does the same): the 135M bench shape's float32 rollout 5.38 -> 4.72 s (8 prompts x 4 samples).
Decoding runs in megatron's flash-decoding mode (``rollout.flash_decode``, default on; kernels in
models/flash_decode.py where flash-attn is absent): each new key is rotated once and cached rotated, where the
static mode re-rotates every cached key at every step; 16-bit models on the CPU keep a float32 cache, read
without a cast. Same tokens and log-probs as the static mode (tested); 135M bf16, 192 new tokens: 15.4 -> 10.8 s.
Multi-latent attention (DeepSeek-V3), YaRN, attention sinks and sliding windows (GPT-OSS) decode in megatron's static
scheme (MLA applies RoPE inside the attention at one offset for every row; the flash-decoding path has none of the
others). Pipeline parallelism is not supported by this engine (use SGLang or vLLM); configs are rejected early.

Pausing (``rollout.partial``): :meth:`LocalEngine.pause` stops every generation at the next token boundary; the
responses not finished there come back with finish_reason ``abort``, their tokens and log-probs those of the weights
that were loaded, and are resumed later from prompt + partial response (the KV cache recomputed). With tensor
parallelism the ranks agree on the boundary (a one-element all-reduce per token, only in an interruptible engine).

``share_policy_weights`` (synchronous training, where generation never overlaps an optimizer step): the
replica's parameters point at the policy's own tensors instead of holding a copy - one set of weights fewer in
memory and no copy per sync; the generated tokens are the same (the weights are the same values at generation
time). Asynchronous training needs the copy (the trainer updates the policy while the engine generates).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_kl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_kl.models.builder import build_gpt_model, freeze
from megatron_kl.models.output_head import unwrap
from megatron_kl.models.routing_replay import UNKNOWN, RoutingRecorder
from megatron_kl.models.state import ExpertGroups, is_expert, local_experts_per_layer, shift_expert_index
from megatron_kl.rollout.delta import SyncStats, TensorUpdate, diff, tensor_checksum
from megatron_kl.rollout.engine import PAUSED, Completion, EngineBase, SamplingConfig, checked_budgets
from megatron_kl.rollout.quantization import quantize_model_
from megatron_kl.vocab_parallel.truncation import Truncation, support_threshold

log = logging.getLogger(__name__)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) all but the top-k tokens and the smallest nucleus holding top_p of the top-k mass, ties
    at either cut kept (``vocab_parallel.truncation``: the rule the trainer's truncated distribution uses). ``logits``
    [..., V] are already divided by the temperature."""
    rule = Truncation(top_k=top_k, top_p=top_p)
    if not rule.active(logits.shape[-1]):
        return logits
    flat = logits.reshape(-1, logits.shape[-1])
    threshold = support_threshold(flat, None, rule).to(logits.dtype)
    return flat.masked_fill(flat < threshold[:, None], float("-inf")).reshape(logits.shape)


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig, draws: torch.Tensor):
    """Draw one token per row of full-vocabulary ``logits [B, V]`` (float32) with the rows' uniforms
    ``draws [B]`` (float64, U ~ Uniform[0, 1); unused when greedy).

    Returns (tokens [B], behaviour log-probs [B]): log mu of the distribution that sampled (the tempered
    softmax, truncated to ``filter_logits``' support and renormalised when top-k / top-p are set).

    Sampling inverts the CDF: with C_a = sum_{b<=a} p_b accumulated in float64 and one U ~ Uniform[0, 1)
    per row, the token is the first a with C_a > U * C_V, i.e. a with probability p_a exactly (up to float64
    rounding of the running sum, ~1e-16 relative). A token of probability 0 never has C_a > C_{a-1}, so it
    is never drawn. One uniform per row and a cumulative sum instead of ``torch.multinomial``, which costs
    ~25 ms per [32, 49152] call on 2 CPU cores (this: ~1.3 ms).
    """
    scaled = logits / sampling.logprob_temperature
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
    elif _unfiltered(sampling, logits.shape[-1]):  # one exp pass serves the draw and the log-probs
        top = scaled.amax(-1, keepdim=True)
        cdf = (scaled - top).exp_().to(torch.float64).cumsum_(-1)  # unnormalised: C_V = sum_a exp(z_a - max)
        tokens = _invert(cdf, draws)
        chosen = scaled.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1)
        return tokens, chosen - torch.log(cdf[:, -1]).to(chosen.dtype)
    else:
        filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
        tokens = _invert(torch.softmax(filtered, dim=-1).to(torch.float64).cumsum_(-1), draws)
        chosen = filtered.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, chosen - torch.logsumexp(filtered, dim=-1)
    chosen = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen - torch.logsumexp(scaled, dim=-1)


def _unfiltered(sampling: SamplingConfig, vocab: int) -> bool:
    return sampling.top_p >= 1.0 and (sampling.top_k <= 0 or sampling.top_k >= vocab)


def _invert(cdf: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row, the first index a with cdf_a > U * cdf_V (U ~ Uniform[0, 1), one per row: ``draws``)."""
    draw = draws.to(device=cdf.device, dtype=torch.float64)[:, None]
    return torch.searchsorted(cdf, draw * cdf[:, -1:], right=True).squeeze(-1).clamp_max_(cdf.shape[-1] - 1)


class PositionDraws:
    """The rows' sampling uniforms in megatron's static order: one per row for every frame step from the shortest
    prompt's end on, drawn from the generator as the steps come (none for greedy sampling). Row i's t-th response
    token takes frame step len_i - min len + t in either decoding scheme, so a seed samples the same tokens whether
    the longer prompts' tokens are forced or the rows decode at their own positions, and the generator is left
    where the forcing scheme leaves it."""

    def __init__(self, generator: torch.Generator, prompt_len: torch.Tensor, new_tokens: int, random: bool):
        self.generator, self.random = generator, random
        self.offsets = prompt_len - prompt_len.min()
        batch = prompt_len.shape[0]
        self.uniforms = torch.zeros(int(self.offsets.max()) + new_tokens, batch, dtype=torch.float64)
        self.drawn_steps = 0  # frame steps drawn so far (rows of ``uniforms``)

    def _draw_through(self, frame_step: int) -> None:
        while self.random and self.drawn_steps <= frame_step:  # torch.rand(batch)'s stream, row by row
            self.uniforms[self.drawn_steps].uniform_(generator=self.generator)
            self.drawn_steps += 1

    def frame(self, frame_step: int) -> torch.Tensor:
        """Every row's uniform at one frame step (the forcing scheme)."""
        self._draw_through(frame_step)
        return self.uniforms[frame_step]

    def response(self, t: int, active: torch.Tensor) -> torch.Tensor:
        """Row i's uniform for its t-th response token (rows decoding at their own positions); draws only as far
        as the ``active`` rows need."""
        steps = self.offsets + t
        if bool(active.any()):
            self._draw_through(int(steps[active].max()))
        return self.uniforms[steps, torch.arange(steps.shape[0])]


class _Rows:
    """The batch being generated: tokens and behaviour log-probs at each row's true positions (prompt, then
    response), each row's budget end, and which rows are finished / stopped by a stop token."""

    def __init__(self, prompts, sampling: SamplingConfig, budgets: Optional[Sequence[int]] = None):
        self.prompt_len = torch.as_tensor([len(p) for p in prompts])
        budget = sampling.max_new_tokens if budgets is None else torch.as_tensor(list(budgets))
        self.end = self.prompt_len + budget  # exclusive end of each row's budget
        batch, total = len(prompts), int(self.end.max())
        self.tokens = torch.zeros(batch, total, dtype=torch.long)
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        self.logprobs = torch.zeros(batch, total)
        self.stop_ids = torch.as_tensor(sampling.stop_token_ids or [-1], dtype=torch.long)
        self.finished = torch.zeros(batch, dtype=torch.bool)
        self.stopped = torch.zeros(batch, dtype=torch.bool)
        self.generated = torch.zeros(batch, dtype=torch.long)  # response tokens recorded per row
        self.routing: Optional[torch.Tensor] = None  # mixture-of-experts: [B, total, L, k] expert ids, -1 unrouted

    def record_routing(
        self, ids: Optional[torch.Tensor], positions: torch.Tensor, rows: Optional[torch.Tensor] = None
    ) -> None:
        """Expert ids ``[b, n, L, k]`` of the tokens the engine fed at true ``positions [b, n]`` of ``rows`` (default:
        every row)."""
        if ids is None:
            return
        if self.routing is None:
            self.routing = torch.full((*self.tokens.shape, *ids.shape[2:]), UNKNOWN, dtype=ids.dtype)
        rows = torch.arange(ids.shape[0]) if rows is None else rows
        self.routing[rows[:, None].expand_as(positions), positions] = ids

    def record(self, position: torch.Tensor, sampled, sampled_logprobs, generating: torch.Tensor) -> None:
        """The ``generating`` rows' sampled tokens at their ``position [B]``; marks rows done."""
        sampled, sampled_logprobs = sampled.cpu(), sampled_logprobs.cpu()  # the model's device -> the batch's
        rows = torch.arange(position.shape[0])
        self.tokens[rows, position] = torch.where(generating, sampled, self.tokens[rows, position])
        self.logprobs[rows, position] = torch.where(generating, sampled_logprobs, self.logprobs[rows, position])
        self.generated += generating.long()
        hit_stop = generating & torch.isin(sampled, self.stop_ids)
        self.stopped |= hit_stop
        self.finished |= hit_stop | (generating & (position + 1 >= self.end))


def _engine_tp_group(tp_size: int):
    """A second process group with the same ranks as megatron's TP group (created collectively)."""
    from megatron.core import parallel_state

    if tp_size == 1 or not dist.is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    mine, _ = dist.new_subgroups(group_size=tp_size)
    expected = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    if dist.get_process_group_ranks(mine) != expected:
        raise RuntimeError(f"engine TP group {dist.get_process_group_ranks(mine)} != megatron's {expected}")
    return mine


def _replica_holds_all_experts(parallel: ParallelConfig, groups) -> ParallelConfig:
    """The replica's layout when the policy splits its experts over ranks: every expert on every rank (each
    data-parallel rank generates its own prompts, so the replica's forwards cannot meet in expert-parallel
    collectives), sharded over the engine's TP group like the dense layers. Creates one-rank groups
    (collectively)."""
    if parallel.expert_tensor_parallel not in (None, parallel.tensor_parallel):
        raise ConfigError(
            f"rollout.engine=local with parallel.expert_tensor_parallel={parallel.expert_tensor_parallel} != "
            f"tensor_parallel={parallel.tensor_parallel}: the replica shards its experts like the dense layers; "
            "leave expert_tensor_parallel null, or use rollout.engine=sglang / vllm"
        )
    alone, _ = dist.new_subgroups(group_size=1)
    groups.ep, groups.expt_dp = alone, alone
    groups.expt_tp, groups.tp_ep = groups.tp, groups.tp
    return dataclasses.replace(parallel, expert_parallel=1, expert_tensor_parallel=None)


def _gathered_experts(policy, ep_group):
    """The policy's (name, tensor) pairs, routed experts gathered over ``ep_group`` when it is given (expert j of
    expert-parallel rank r becomes local expert r E_local + j); a collective on every rank of the group."""
    local = local_experts_per_layer([policy])
    for name, param in policy.named_parameters():
        if ep_group is None or not is_expert(name):
            yield name, param.detach()
            continue
        pieces = [torch.empty_like(param) for _ in range(dist.get_world_size(ep_group))]
        dist.all_gather(pieces, param.detach().contiguous(), group=ep_group)
        for rank, piece in enumerate(pieces):
            yield shift_expert_index(name, rank * local), piece


class LocalEngine(EngineBase):
    """In-process engine over a GPTModel replica in the policy's TP layout (PP must be 1)."""

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelConfig,
        max_batch_size: int = 256,
        share_policy_weights: bool = False,
        flash_decode: bool = True,
        ragged_decoding: bool = True,
        interruptible: bool = False,
        quantization: str = "none",
        delta_sync: bool = False,
        delta_check_interval: int = 10,
    ):
        from megatron.core.process_groups_config import ProcessGroupCollection

        if parallel.pipeline_parallel != 1:
            raise ConfigError(
                "rollout.engine=local supports parallel.pipeline_parallel=1 only; use rollout.engine=sglang "
                "or vllm with pipeline parallelism"
            )
        self.model_config = model.resolved()
        self.max_batch_size = max_batch_size
        groups = ProcessGroupCollection.use_mpu_process_groups()
        groups.tp = _engine_tp_group(parallel.tensor_parallel)
        self.tp_group, self.tp_size = groups.tp, parallel.tensor_parallel
        self.expert_gather = None  # the policy's expert-parallel group when the replica holds every expert
        if model.moe.enabled and parallel.expert_parallel > 1:
            parallel = _replica_holds_all_experts(parallel, groups)
            self.expert_gather = ExpertGroups.from_megatron().ep
        # multi-latent attention applies RoPE inside the attention at the context's one offset, and megatron's
        # flash decoding has no YaRN, attention sinks or windows: megatron's static scheme, every row at one position
        flash_decode = flash_decode and not (
            model.multi_latent_attention
            or model.yarn.enabled
            or model.attention_sinks
            or model.sliding_window is not None
        )
        if flash_decode:
            from megatron_kl.models import flash_decode as kernels

            kernels.install()
        self.model = freeze([build_gpt_model(model, parallel, pg_collection=groups, flash_decode=flash_decode)])[0]
        # mixture-of-experts: every forward's expert choice, returned with the completions (routing replay)
        self.routing = RoutingRecorder(self.model, model.num_layers) if model.moe.enabled else None
        self._last_routing: Optional[torch.Tensor] = None
        self.device = next(self.model.parameters()).device
        self.cache_dtype = self._cache_dtype(flash_decode)
        self.weight_version = 0
        self.quantization = quantization  # fp8: the replica holds block-wise FP8 weights (a copy, never shared)
        self.share_policy_weights = share_policy_weights and quantization == "none"
        # rollout.delta_sync: after the first sync, copy only the elements whose bits changed (rollout/delta.py)
        self.delta_sync, self.delta_check_interval = delta_sync, delta_check_interval
        self._delta_syncs = None  # delta syncs since the last full one (None: no full sync yet)
        self.last_sync = None  # rollout/delta.SyncStats of the last update_weights
        self.ragged_decoding = ragged_decoding  # False: always megatron's forcing scheme (benchmarks, tests)
        self._lock = threading.Lock()
        self.interruptible = interruptible
        self._paused = threading.Event()

    # -- pausing ---------------------------------------------------------------------------------
    def pause(self) -> None:
        """Generation in flight (or started before :meth:`resume`) stops at the next token boundary; unfinished
        responses return with finish_reason ``abort``."""
        if self.tp_size > 1 and not self.interruptible:
            raise RuntimeError(
                "this engine was built with interruptible=False: its tensor-parallel ranks do not "
                "agree on a pause point (rollout.partial=true builds it interruptible)"
            )
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def _pause_agreed(self) -> bool:
        """Whether to stop at this token boundary: any tensor-parallel rank's pause stops them all together."""
        if self.tp_size == 1:
            return self._paused.is_set()
        if not self.interruptible:
            return False
        flag = torch.tensor([1.0 if self._paused.is_set() else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.tp_group)
        return bool(flag.item() > 0)

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, source: list, version: int) -> None:
        """Copy this rank's shards of the policy chunks ``source`` (possibly DDP-wrapped), or with
        ``share_policy_weights`` point the replica's parameters at them (re-pointed at every call, so a policy
        whose tensors were replaced, e.g. by a checkpoint load, is followed)."""
        with self._lock:
            start = time.perf_counter()
            policy = unwrap(source[0])
            mine = dict(self.model.named_parameters())
            delta = self.delta_sync and not self.share_policy_weights and self._delta_syncs is not None
            stats = SyncStats(
                kind="delta" if delta else "full",
                reason="" if delta else "first sync" if self.delta_sync else "rollout.delta_sync=false",
            )
            check = delta and (self._delta_syncs + 1) % self.delta_check_interval == 0
            stats.checked = check
            mismatched = []
            for name, param in _gathered_experts(policy, self.expert_gather):
                if name not in mine:
                    raise KeyError(f"engine model has no parameter {name}")
                target = mine[name]
                if target.shape != param.shape:
                    raise ValueError(
                        f"engine parameter {name} is {tuple(target.shape)}, the policy's "
                        f"{tuple(param.shape)}: different layouts"
                    )
                if self.share_policy_weights and target.dtype == param.dtype:
                    target.data = param.detach()
                    stats.add(None, param)  # nothing copied
                elif delta:
                    update = diff(name, target, param.detach(), checksum=False)
                    if update is not None:
                        update.apply_to(target)
                    stats.add(update, param)
                    if check and tensor_checksum(target) != tensor_checksum(param):
                        mismatched.append(name)
                else:
                    target.copy_(param.detach())
                    stats.add(TensorUpdate(name, tuple(param.shape), full=param), param)
            if mismatched:  # the replica drifted from the policy: every tensor copied again
                log.warning(
                    "weight sync version %d: %d tensor(s) differ from the policy after the delta (first: %s); "
                    "copying every tensor",
                    version,
                    len(mismatched),
                    mismatched[0],
                )
                for name, param in _gathered_experts(policy, self.expert_gather):
                    mine[name].copy_(param.detach())
                stats.kind, stats.reason = "full", f"checksum mismatch in {mismatched[0]}"
            if self.quantization == "fp8":
                quantize_model_(self.model)
            if self.delta_sync and not self.share_policy_weights:
                self._delta_syncs = 0 if stats.kind == "full" else self._delta_syncs + 1
            stats.seconds = time.perf_counter() - start
            self.last_sync = stats
            self.weight_version = version

    def shutdown(self) -> None:
        self.model = None

    # -- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: Optional[int] = None,
        budgets: Optional[Sequence[int]] = None,
    ) -> list[Completion]:
        """One completion per prompt; ``budgets`` (per prompt, each <= sampling.max_new_tokens): the new tokens each
        may take instead of max_new_tokens (resumed responses)."""
        if not prompts:
            return []
        budgets = checked_budgets(budgets, len(prompts), sampling)
        out: list[Completion] = []
        generator = torch.Generator().manual_seed(sampling.seed if seed is None else seed)
        with self._lock:
            for start in range(0, len(prompts), self.max_batch_size):
                chunk = prompts[start : start + self.max_batch_size]
                if self._pause_agreed():  # paused before this chunk began: nothing generated for it
                    out.extend(Completion(list(p), [], [], PAUSED, self.weight_version) for p in chunk)
                    continue
                out.extend(
                    self._generate_batch(
                        chunk, sampling, generator, None if budgets is None else budgets[start : start + len(chunk)]
                    )
                )
        return out

    def _forward(self, tokens: torch.Tensor, offset: int, context) -> torch.Tensor:
        tokens = tokens.to(self.device)
        positions = torch.arange(offset, offset + tokens.shape[1], device=self.device).unsqueeze(0).expand_as(tokens)
        logits = self.model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
        context.sequence_len_offset += tokens.shape[1]
        self._last_routing = self.routing.take(*tokens.shape) if self.routing is not None else None
        return logits[:, -1, : self.model_config.vocab_size].float()

    def _prefill(self, prefix: torch.Tensor, total: int):
        """KV cache, last-position logits and expert ids (mixture of experts; else None) of ``prefix [B, first]``
        (the prompts' common length), each distinct prefix computed once: GRPO's group_size samples of a prompt
        share it, so the prefill runs on the distinct rows and their cache entries, logits and routing are copied
        to every row that has them."""
        from megatron.core.inference.contexts import StaticInferenceContext

        batch = prefix.shape[0]
        distinct, row_of = torch.unique(prefix, dim=0, return_inverse=True)
        if distinct.shape[0] == batch:
            return self._prefill_rows(prefix, total)
        shared, logits, routing = self._prefill_rows(distinct, total)
        routing = None if routing is None else routing.index_select(0, row_of)
        row_of = row_of.to(self.device)
        context = StaticInferenceContext(batch, total)
        # megatron's static cache: per layer (keys, values), each [max_sequence, max_batch, groups, head_dim]
        context.key_value_memory_dict = {
            layer: tuple(t.index_select(1, row_of) for t in kv) for layer, kv in shared.key_value_memory_dict.items()
        }
        context.sequence_len_offset = shared.sequence_len_offset
        return context, logits.index_select(0, row_of), routing

    def _prefill_rows(self, prefix: torch.Tensor, total: int):
        """A fresh KV cache for ``prefix [B, first]`` row by row, the last position's logits and the prefix's expert
        ids (None for a dense model)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        context = StaticInferenceContext(prefix.shape[0], total)
        if self.cache_dtype is not None:  # megatron uses the buffers it finds in the context
            for layer in self.model.decoder.layers:
                attention = layer.self_attention
                context.key_value_memory_dict[attention.layer_number] = tuple(
                    attention._allocate_memory(total, prefix.shape[0], size, self.cache_dtype)
                    for size in (attention.key_hidden_size, attention.val_hidden_size)
                )
        logits = self._forward(prefix, 0, context)
        return context, logits, self._last_routing

    def _ragged_decoding(self) -> bool:
        """Rows decode at their own lengths where the flash-decoding kernels are models/flash_decode.py's."""
        from megatron_kl.models import flash_decode as kernels

        return self.ragged_decoding and bool(self.model.config.flash_decode) and kernels.uses_cpu_kernels()

    def _decode_forcing_prompts(self, batch: _Rows, sampling: SamplingConfig, draws: PositionDraws) -> None:
        """Megatron's static scheme: prefill the shortest prompt, then one position per forward for every row,
        feeding the longer prompts' own tokens until each row's prompt is done."""
        first, longest = int(batch.prompt_len.min()), int(batch.prompt_len.max())
        total = batch.tokens.shape[1]
        context, logits, routing = self._prefill(batch.tokens[:, :first], total)
        batch.record_routing(routing, torch.arange(first).expand(len(batch.tokens), first))
        for pos in range(first, total):
            sampled, sampled_lp = sample_tokens(logits, sampling, draws.frame(pos - first))
            position = torch.full_like(batch.prompt_len, pos)
            batch.record(position, sampled, sampled_lp, (pos >= batch.prompt_len) & ~batch.finished)
            if bool(batch.finished.all()) or pos + 1 == total or self._pause_agreed():
                break
            if pos + 1 >= longest:
                context.enable_decode_mode()
            logits = self._forward(batch.tokens[:, pos : pos + 1], pos, context)
            batch.record_routing(self._last_routing, torch.full((len(batch.tokens), 1), pos))

    def _decode_ragged(self, batch: _Rows, sampling: SamplingConfig, draws: PositionDraws) -> None:
        """Every row's prompt prefilled whole (one forward per distinct length), then every row decodes from the
        first step: row i's t-th token at its true position len_i + t, frame slot longest + t
        (models/flash_decode.ragged_rows)."""
        from megatron_kl.models.flash_decode import ragged_rows

        longest = int(batch.prompt_len.max())
        context, logits = self._prefill_ragged(batch)
        context.enable_decode_mode()
        with ragged_rows(batch.prompt_len, longest):
            for step in range(int((batch.end - batch.prompt_len).max())):
                generating = ~batch.finished
                sampled, sampled_lp = sample_tokens(logits, sampling, draws.response(step, generating))
                batch.record(batch.prompt_len + step, sampled, sampled_lp, generating)
                if bool(batch.finished.all()) or self._pause_agreed():
                    break
                logits = self._forward(sampled[:, None], longest + step, context)
                batch.record_routing(self._last_routing, (batch.prompt_len + step)[:, None])

    def _prefill_ragged(self, rows_state: _Rows):
        """One static context in which row i's prompt fills frame slots [0, len_i) (each length's rows prefilled
        together, shared prefixes once), and every row's last-prompt-position logits; offset = longest prompt.
        The prompts' expert ids go into ``rows_state``."""
        from megatron.core.inference.contexts import StaticInferenceContext

        tokens, prompt_len, total = rows_state.tokens, rows_state.prompt_len, rows_state.tokens.shape[1]
        batch, longest = tokens.shape[0], int(prompt_len.max())
        context = StaticInferenceContext(batch, total)
        logits = None
        for length in sorted(set(prompt_len.tolist())):
            rows = torch.nonzero(prompt_len == length).flatten()
            part, part_logits, routing = self._prefill(tokens[rows, :length], total)
            rows_state.record_routing(routing, torch.arange(length).expand(len(rows), length), rows)
            rows = rows.to(self.device)
            if logits is None:
                logits = part_logits.new_empty(batch, part_logits.shape[-1])
                context.key_value_memory_dict = {
                    layer: tuple(t.new_zeros(t.shape[0], batch, *t.shape[2:]) for t in kv)
                    for layer, kv in part.key_value_memory_dict.items()
                }
            logits[rows] = part_logits
            for layer, kv in part.key_value_memory_dict.items():
                for frame, cache in zip(context.key_value_memory_dict[layer], kv):
                    frame[:length, rows] = cache[:length]  # past the prompt: unwritten memory (masked, yet NaN * 0)
        context.sequence_len_offset = longest
        return context, logits

    def _cache_dtype(self, flash_decode: bool) -> Optional[torch.dtype]:
        """float32 KV cache for a 16-bit model whose flash decoding runs on models/flash_decode.py's kernels and
        whose prefill attention is SDPAttention (both attend in float32 on the CPU: the cache is then read without
        a cast per step); None: megatron's own (the model's dtype)."""
        from megatron_kl.models import flash_decode as kernels
        from megatron_kl.models.attention import SDPAttention, attention_dtype

        dtype = self.model.config.params_dtype
        cache = attention_dtype(dtype, next(self.model.parameters()).device)
        sdpa = all(isinstance(layer.self_attention.core_attention, SDPAttention) for layer in self.model.decoder.layers)
        return cache if flash_decode and sdpa and kernels.uses_cpu_kernels() and cache != dtype else None

    def _generate_batch(self, prompts, sampling: SamplingConfig, generator, budgets=None) -> list[Completion]:
        """Either scheme samples with the same uniforms (:class:`PositionDraws`)."""
        lengths = [len(p) for p in prompts]
        first, longest = min(lengths), max(lengths)
        if first == 0:
            raise ValueError("rollout prompt with no tokens: every prompt needs at least one token")
        new = sampling.max_new_tokens if budgets is None else max(budgets)
        total = longest + new
        if total > self.model_config.max_position_embeddings:
            raise ValueError(
                f"prompt ({longest}) + max_new_tokens ({new}) exceeds "
                f"model.max_position_embeddings={self.model_config.max_position_embeddings}"
            )
        rows = _Rows(prompts, sampling, budgets)
        draws = PositionDraws(generator, rows.prompt_len, new, random=sampling.temperature > 0)
        self.model.eval()
        # one prefill forward per distinct length against one forward per forced position (both small)
        if 0 < len(set(lengths)) - 1 <= longest - first and self._ragged_decoding():
            self._decode_ragged(rows, sampling, draws)
        else:
            self._decode_forcing_prompts(rows, sampling, draws)
        completions = []
        for i, p in enumerate(prompts):
            response = rows.tokens[i, len(p) : len(p) + int(rows.generated[i])]
            # Trim the tokens after a stop token (rows stop at different steps).
            stop_at = torch.nonzero(torch.isin(response, rows.stop_ids)).flatten()
            n = int(stop_at[0]) + 1 if len(stop_at) else len(response)
            completions.append(
                Completion(
                    prompt_ids=list(p),
                    response_ids=response[:n].tolist(),
                    response_logprobs=rows.logprobs[i, len(p) : len(p) + n].tolist(),
                    finish_reason="stop" if rows.stopped[i] else "length" if rows.finished[i] else PAUSED,
                    weight_version=self.weight_version,
                    # every fed token's experts: the prompt and all response tokens but the last
                    routed_experts=None if rows.routing is None else rows.routing[i, : len(p) + n - 1].clone(),
                )
            )
        return completions
