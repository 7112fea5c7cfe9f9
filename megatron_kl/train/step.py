"""One RL step on a rollout batch: reference and old log-probs, KL-shaped advantages, PPO/RPG updates.

1. reference pass (frozen pi_ref): log-probs, and the final hidden states for the exact KL;
2. old pass (pi_old = the policy before this step's updates): log-probs, entropies, exact KL_t;
3. returns: kl_shaped_returns(KLConfig) -> the reward part's sequence advantage (GRPO/RLOO/...) and the
   KL part -coef * c_t kept separate (see megatron_kl.algo.losses);
4. algo.ppo_epochs x algo.minibatches optimizer steps over shuffled minibatches.

Metrics compare pi_old with pi_ref (k1, k3, exact; per token and per sequence), pi_old with the sampler mu
(train-vs-rollout mismatch, importance ratios) and report clip fractions, clamps, grad norms and timings.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_kl.algo.advantages import sequence_advantages
from megatron_kl.algo.losses import MICROBATCH_TOKENS, LossInputs, MicrobatchLoss, Shares
from megatron_kl.kl.config import TOP_K
from megatron_kl.kl.corrections import mismatch_metrics
from megatron_kl.kl.estimators import ClampCounter, TermCounter, kl_metrics
from megatron_kl.kl.objective import kl_shaped_returns
from megatron_kl.kl.topk import top_k_divergence
from megatron_kl.models import context_parallel, optim, output_head, pipeline, routing_replay
from megatron_kl.models.moe_load import ExpertLoad
from megatron_kl.models.offload import ReferenceOffload
from megatron_kl.models.parallel import all_reduce_cpu
from megatron_kl.rollout.http import CorruptResponse
from megatron_kl.run.run_state import Counters
from megatron_kl.train.profiling import phase
from megatron_kl.train.rollouts import RolloutBatch
from megatron_kl.train.step_schedule import (
    anchor_objective,
    metrics_due,
    needs_exact_kl,
    needs_reference,
    regularizer_due,
)
from megatron_kl.train.topology import Topology

if TYPE_CHECKING:
    from megatron_kl.distill.teacher import Teacher
    from megatron_kl.train.config import TrainConfig


log = logging.getLogger(__name__)


@dataclass
class StepContext:
    """What one RL step reads and updates besides its batch: the models, the optimizer state, the process groups,
    and the step-to-step counts (clamped log-ratios, skipped updates)."""

    cfg: "TrainConfig"
    train_state: optim.TrainState
    reference: list  # frozen reference chunks
    reference_head: output_head.ReferenceHead
    offload: ReferenceOffload
    topology: Topology = field(default_factory=Topology)
    clamps: ClampCounter = field(default_factory=ClampCounter)  # log-ratios clamped this step (kl/clamped_*)
    consecutive_skips: int = 0  # optimizer steps skipped in a row (non-finite gradient)
    counters: Counters = field(default_factory=Counters)  # optimizer steps applied / skipped (run/run_state.py)
    kl_tags: dict = field(default_factory=dict)  # logged every step: kl/biased (the audit's verdict for kl.target)
    expert_load: Optional[ExpertLoad] = None  # mixture-of-experts policies: router counts of the pi_old pass
    teacher: Optional["Teacher"] = None  # on-policy distillation (distill.*): the frozen teacher, None without

    @property
    def anchor_head(self) -> output_head.ReferenceHead:
        """The head of the model the exact KL is taken to: the teacher's under distillation, else the reference's."""
        return self.teacher.head if self.teacher is not None else self.reference_head

    @property
    def anchor_offload(self):
        return self.teacher.offload if self.teacher is not None else self.offload

    def exact_heads(self, regularizing: bool):
        """The heads this step's exact KLs are taken through: :attr:`anchor_head`, with the reference's beside the
        teacher's when ``regularizing`` (the batch then carries the reference's hidden states: ``regularizer_hidden``,
        on the last pipeline stage)."""
        if self.teacher is not None and regularizing:
            return output_head.WithRegularizer(self.teacher.head, self.reference_head)
        return self.anchor_head

    def resident(self, stack: ExitStack, regularizing: bool) -> None:
        """Bring the models :meth:`exact_heads` reads back from host memory for the block of ``stack``."""
        stack.enter_context(self.anchor_offload.resident())
        if self.teacher is not None and regularizing:
            stack.enter_context(self.offload.resident())


class NonFiniteUpdates(RuntimeError):
    """Too many optimizer steps in a row had a NaN/inf gradient (``train.max_consecutive_skips``)."""


def record_update(ctx: StepContext, update_successful: bool, step: int, max_consecutive_skips: int) -> bool:
    """Count an optimizer step skipped for a NaN/inf gradient; past ``max_consecutive_skips`` in a row the
    run stops (``NonFiniteUpdates``). Returns ``update_successful``."""
    if update_successful:
        ctx.consecutive_skips = 0
        ctx.counters.optimizer_steps += 1
        return True
    ctx.consecutive_skips += 1
    ctx.counters.skipped_updates += 1
    log.warning(
        "step %d: gradient not finite, optimizer step skipped (%d in a row; limit train.max_consecutive_skips=%d)",
        step,
        ctx.consecutive_skips,
        max_consecutive_skips,
    )
    if ctx.consecutive_skips > max_consecutive_skips:
        raise NonFiniteUpdates(
            f"step {step}: {ctx.consecutive_skips} optimizer steps in a row had a NaN/inf gradient (limit "
            f"train.max_consecutive_skips={max_consecutive_skips}); the last checkpoint holds the weights before "
            "them. Look at the rewards, the behaviour log-probs and kl.clamp / algo.tis_cap, or lower the "
            "learning rate"
        )
    return False


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp_min(1))


def rollout_metrics(batch: RolloutBatch, old_logprobs: torch.Tensor, step: int) -> dict:
    mask = batch.loss_mask
    mismatch = ((old_logprobs - batch.behavior_logprobs) * mask).abs()
    staleness = (step - batch.weight_versions).float()  # per sample: its oldest token's
    token_lag = (step - batch.versions).float() * mask
    versions = [set(c.versions) for c in batch.completions]
    # rewards of the samples that were scored (failed ones, reward.on_failure=exclude, are not zeros to average)
    scored = batch.rewards if batch.reward_valid is None else batch.rewards[batch.reward_valid]
    if not scored.numel():
        scored = torch.zeros(1)
    return {
        **batch.reward_metrics,
        **mismatch_metrics(old_logprobs, batch.behavior_logprobs, mask),
        "reward/mean": float(scored.mean()),
        "reward/std": float(scored.std(unbiased=False)),
        "reward/accuracy": float((scored >= 1.0).float().mean()),
        "response/length_mean": float(mask.sum(-1).mean()),
        # tokens the training passes see: real (prompt + response) and as padded to the longest sequence
        "batch/tokens": float(sum(len(c.prompt_ids) + len(c.response_ids) for c in batch.completions)),
        "batch/padded_tokens": float(batch.tokens.numel()),
        "response/stopped_fraction": sum(c.finish_reason == "stop" for c in batch.completions) / len(batch.completions),
        "mismatch/abs_logprob_mean": _masked_mean(mismatch, mask),
        "mismatch/abs_logprob_max": float(mismatch.max()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        # per response token: the weights that sampled it (partial rollouts: a response can span several versions)
        "staleness/token_mean": _masked_mean(token_lag, mask),
        "staleness/token_max": float(token_lag.max()) if mask.numel() else 0.0,
        "staleness/older_token_fraction": _masked_mean((token_lag > 0).float(), mask),
        "staleness/mixed_response_fraction": sum(len(v) > 1 for v in versions) / max(len(versions), 1),
    }


class OutsideSupport(CorruptResponse):
    """Sampled tokens outside the trainer's truncated support at the weights that sampled them."""


def support_metrics(batch: RolloutBatch, old: pipeline.TokenStats, step: int, sampling, dp_group) -> dict:
    """The truncated policy's support over the response tokens (empty without truncation): the mass it leaves
    out of the full softmax, its size, and the sampled tokens outside it. A token the engine sampled must lie
    in the trainer's support at the weights that sampled it (rows of this step's weight version); more than
    ``rollout.sampling.support_tolerance`` of them outside (over every data-parallel rank) is an error naming
    the first one, raised on every rank together."""
    if not old.truncated:
        return {}
    mask = batch.loss_mask
    outside = old.outside_support * mask
    fresh = (batch.versions == step) & (mask > 0)  # tokens sampled by this step's weights
    stray = (outside > 0) & fresh
    counts = torch.tensor([float(stray.sum()), float(fresh.sum())], dtype=torch.float64)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        counts = all_reduce_cpu(counts, dp_group)
    strays, fresh_tokens = int(counts[0]), int(counts[1])
    if fresh_tokens and strays > sampling.support_tolerance * fresh_tokens:
        where = "on another data-parallel rank"
        if bool(stray.any()):
            row, position = (int(i) for i in stray.nonzero()[0])
            where = f"completion {row}, response position {position + 1 - len(batch.completions[row].prompt_ids)}"
        raise OutsideSupport(
            f"{strays} of {fresh_tokens} sampled tokens lie outside the trainer's top-k/top-p support at the weights "
            f"that sampled them (first: {where}): the engine does not sample the distribution the trainer trains "
            f"(rollout.sampling.top_k={sampling.top_k}, top_p={sampling.top_p}, temperature={sampling.temperature}) "
            "or its logits differ beyond rounding; rollout.sampling.support_tolerance sets the fraction allowed"
        )
    return {
        "sampling/truncated_mass": _masked_mean(1.0 - old.kept_mass, mask),
        "sampling/support_size": _masked_mean(old.support_size, mask),
        "sampling/outside_support": _masked_mean(outside, mask),
    }


def replay_metrics(own: Optional[torch.Tensor], batch: RolloutBatch) -> dict:
    """With routing replay, on metric steps: the train-vs-rollout mismatch pi_old would have had with the trainer's
    own routing (``own``: the pass without replay), next to the replayed one (mismatch/abs_logprob_mean)."""
    if own is None:
        return {}
    mask = batch.loss_mask
    return {"moe/mismatch_without_replay": _masked_mean((own - batch.behavior_logprobs).abs() * mask, mask)}


def _reduce(metrics: dict, group) -> dict:
    if group is None or dist.get_world_size(group) == 1:
        return metrics
    keys = sorted(metrics)
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, keys, group=group)
    if any(other != keys for other in names):  # a key only some ranks log (reward/extra/<name>): averaged over those
        keys = sorted(set().union(*names))
        present = torch.tensor([float(k in metrics) for k in keys], dtype=torch.float64)
        values = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
        reduced = all_reduce_cpu(torch.cat([values, present]), group)
        return dict(zip(keys, (reduced[: len(keys)] / reduced[len(keys) :]).tolist()))
    values = all_reduce_cpu(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64), group)
    values /= dist.get_world_size(group)
    return dict(zip(keys, values.tolist()))


@dataclass
class Scores:
    """The scoring passes of one step: the reference's, pi_old's and the teacher's stats (None when not run),
    and with routing replay on metric steps pi_old's log-probs under the trainer's own routing."""

    reference: Optional[pipeline.TokenStats] = None
    old: Optional[pipeline.TokenStats] = None
    teacher: Optional[pipeline.TokenStats] = None
    unreplayed: Optional[torch.Tensor] = None
    teacher_top_logprobs: Optional[torch.Tensor] = None  # distill.kl.estimator=topk: [B, S-1, k]
    exact: bool = False  # the passes took the exact KL to the anchor (the reference, or the teacher)
    regularizing: bool = False  # and under distillation the exact KL to the reference beside the teacher's


def _scoring_passes(ctx: StepContext, sequences: pipeline.SequenceBatch, step: int, vocab, timings: dict) -> Scores:
    """The reference forward (when needed this step), the teacher's (under distillation), pi_old's forward (unless
    algo.old_logprobs=from_update takes it from the update) and, with routing replay on metric steps, pi_old's
    log-probs under the trainer's own routing. The exact KL is taken to the teacher under distillation (its hidden
    states captured), else to the reference."""
    cfg = ctx.cfg
    microbatches = cfg.algo.minibatches * cfg.train.micro_batches
    scores = Scores()
    distilling = ctx.teacher is not None
    scores.regularizing = regularizing = distilling and regularizer_due(cfg, step)
    scores.exact = exact = needs_exact_kl(cfg, step) or regularizing  # both exact KLs, or the anchor's alone
    with ExitStack() as resident:
        with phase("reference", timings):  # bringing an offloaded reference back counts here
            resident.enter_context(ctx.offload.resident())
            if needs_reference(cfg, step):
                # the reference is never truncated: every KL is to the full softmax(r / T) (docs/kl-math.md)
                capture = (exact and not distilling) or regularizing
                scores.reference = pipeline.compute_token_stats(
                    ctx.reference,
                    sequences,
                    microbatches,
                    dataclasses.replace(vocab, truncation=None),
                    capture_hidden=capture,
                    token_budget=cfg.train.micro_batch_tokens,
                )
                if capture and scores.reference.hidden is not None:
                    if regularizing:  # kept for the exact KL to the reference beside the teacher's
                        sequences.regularizer_hidden = scores.reference.hidden
                    else:
                        sequences.reference_hidden = scores.reference.hidden
        if distilling:
            top_k = cfg.distill.kl.top_k if cfg.distill.kl.estimator == TOP_K else 0
            with phase("teacher", timings):  # bringing an offloaded teacher back counts here
                resident.enter_context(ctx.teacher.offload.resident())  # its head serves the pi_old pass too
                scores.teacher = ctx.teacher.score(
                    sequences,
                    microbatches,
                    vocab,
                    capture_hidden=exact or top_k > 0,
                    token_budget=cfg.train.micro_batch_tokens,
                )
                if top_k:  # the teacher as its top-k tokens: the passes below score the student at those ids
                    sequences.teacher_top_ids, scores.teacher_top_logprobs = _teacher_top_k(
                        ctx, scores.teacher.hidden, top_k, vocab, sequences.loss_mask.shape
                    )
                if exact and scores.teacher.hidden is not None:
                    sequences.reference_hidden = scores.teacher.hidden
        anchor = scores.teacher if distilling else scores.reference
        with phase("old_logprobs", timings):
            if cfg.algo.old_logprobs == "recompute":
                with _recording(ctx):
                    scores.old = pipeline.compute_token_stats(
                        ctx.train_state.chunks,
                        sequences,
                        microbatches,
                        vocab,
                        reference=ctx.exact_heads(regularizing) if anchor is not None and exact else None,
                        token_budget=cfg.train.micro_batch_tokens,
                    )
        if _replays(cfg, sequences) and metrics_due(cfg, step):
            with phase("unreplayed_logprobs", timings), routing_replay.suspended(ctx.train_state.chunks):
                scores.unreplayed = pipeline.compute_token_stats(
                    ctx.train_state.chunks, sequences, microbatches, vocab, token_budget=cfg.train.micro_batch_tokens
                ).logprobs
    return scores


def _teacher_top_k(ctx: StepContext, hidden, k: int, vocab, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and log-probs [B, S-1, k] (formed on the last pipeline stage) on every pipeline
    rank."""
    ids, logprobs = ctx.teacher.top_k(hidden, k, vocab, ctx.topology.tp_group)
    size = (*shape, k)
    return (
        pipeline.broadcast_from_last_stage(ids, size, torch.long),
        pipeline.broadcast_from_last_stage(logprobs, size, torch.float32),
    )


def teacher_top_k_divergence(cfg, old: pipeline.TokenStats, teacher_top_logprobs, mask, counter=None):
    """Per position, pi_old's top-k divergence to the teacher (distill.kl.estimator=topk: megatron_kl.kl.topk)."""
    return (
        top_k_divergence(old.candidate_logprobs, teacher_top_logprobs, cfg.distill.kl.top_k_tail, mask, counter) * mask
    )


def _replays(cfg, sequences) -> bool:
    return cfg.model.moe.routing_replay == "rollout" and sequences.routed_experts is not None


def _recording(ctx: StepContext):
    """Count the routers' choices of the pass computing pi_old (mixture-of-experts policies only)."""
    return ctx.expert_load.recording() if ctx.expert_load is not None else nullcontext()


def _stitch(loss: MicrobatchLoss, order: torch.Tensor, shape, candidates: int = 0) -> pipeline.TokenStats:
    """pi_old's stats [N, T] from the update's microbatches (whose rows are ``order``), on every pipeline rank."""
    return pipeline.assemble_token_stats(loss.captured, loss.captured_keys, shape, candidates=candidates).placed(order)


def _update(
    ctx: StepContext, sequences: pipeline.SequenceBatch, step: int, vocab, reference_head
) -> tuple[dict, Optional[pipeline.TokenStats]]:
    """``algo.ppo_epochs x algo.minibatches`` optimizer steps; (summed metrics, pi_old's stats captured from
    the update's forward when there was no pass of their own)."""
    cfg = ctx.cfg
    algo, run = cfg.algo, cfg.train
    num_samples = sequences.tokens.shape[0]
    sums: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    grad_norms, skipped, lr, captured = [], 0, None, None
    shuffle = torch.Generator().manual_seed(run.seed * 7919 + step)
    size = num_samples // algo.minibatches
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(num_samples, generator=shuffle)
        for i in range(algo.minibatches):
            minibatch = sequences.select(order[i * size : (i + 1) * size])
            shares = Shares(num_sequences=size, num_tokens=float(minibatch.loss_mask.sum()))
            axis = context_parallel.sequence_axis(ctx.topology.cp_group)
            loss = MicrobatchLoss(
                algo,
                cfg.kl,
                shares,
                ctx.clamps,
                axis=axis,
                captured=[] if sequences.old_logprobs is None else None,
                captured_keys=pipeline.TokenStats.keys(
                    reference_head is not None,
                    vocab.truncation is not None,
                    sequences.teacher_top_ids is not None,
                    reference_head is not None and reference_head.regularizer is not None,
                ),
                distill=cfg.distill.kl if cfg.distill.enabled else None,
            )
            with ExitStack() as resident:
                if reference_head is not None:
                    ctx.resident(resident, reference_head.regularizer is not None)
                out = optim.train_step(
                    ctx.train_state,
                    minibatch,
                    run.micro_batches,
                    loss,
                    vocab,
                    reference=reference_head,
                    token_budget=run.micro_batch_tokens,
                )
            if record_update(ctx, out.update_successful, step, run.max_consecutive_skips):
                grad_norms.append(out.grad_norm)
            else:
                skipped += 1
            for metrics in out.microbatch_metrics:
                weight = float(metrics.get(MICROBATCH_TOKENS, 1.0))
                for key, value in metrics.items():
                    if key == MICROBATCH_TOKENS:
                        continue
                    if key.startswith("loss/"):
                        sums[key] += float(value)
                    elif key.endswith("_max"):
                        sums[key] = max(sums.get(key, float("-inf")), float(value))
                    else:
                        sums[key] += float(value) * weight
                        counts[key] += weight
            lr = out.lr
            if loss.captured is not None:
                top = sequences.teacher_top_ids
                captured = _stitch(loss, order, tuple(sequences.loss_mask.shape), 0 if top is None else top.shape[-1])
    # per-token metrics: weighted by each microbatch's response tokens (the minibatch value however the rows
    # were split); *_max: the largest
    metrics = {
        k: v if k.endswith("_max") else v / max(counts[k], 1e-12) for k, v in sums.items() if not k.startswith("loss/")
    }
    # loss/* are shares of their minibatch: the minibatch loss is their sum; report the mean minibatch loss.
    metrics.update({k: sums[k] / (algo.ppo_epochs * algo.minibatches) for k in sums if k.startswith("loss/")})
    # mean over the optimizer steps taken; 0 with a count of skips when every step of this RL step was skipped
    metrics["optim/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
    metrics["optim/skipped_updates"] = float(skipped)
    metrics["optim/lr"] = lr
    metrics["optim/steps"] = float(ctx.counters.optimizer_steps)
    return metrics, captured


def common_width(batch: RolloutBatch, group) -> RolloutBatch:
    """The batch right-padded (pad id 0, masked) to the longest sequence over ``group``: experts split over
    ranks meet in every layer's token dispatch, whose all-gather needs the same token count from each rank
    (appended padding changes no earlier position: attention is causal)."""
    if group is None or dist.get_world_size(group) == 1:
        return batch
    width = torch.tensor([float(batch.tokens.shape[1])])
    width = int(all_reduce_cpu(width, group, op=dist.ReduceOp.MAX).item())
    extra = width - batch.tokens.shape[1]
    if extra == 0:
        return batch
    pad = torch.nn.functional.pad
    routing = batch.routed_experts
    if routing is not None:  # [N, S, L, k]: unrouted at the new positions
        routing = pad(routing, (0, 0, 0, 0, 0, extra), value=routing_replay.UNKNOWN)
    versions = batch.token_versions
    return dataclasses.replace(
        batch,
        tokens=pad(batch.tokens, (0, extra)),
        loss_mask=pad(batch.loss_mask, (0, extra)),
        behavior_logprobs=pad(batch.behavior_logprobs, (0, extra)),
        routed_experts=routing,
        token_versions=None if versions is None else pad(versions, (0, extra)),
    )


def rl_step(ctx: StepContext, batch: RolloutBatch, step: int) -> dict:
    cfg, groups = ctx.cfg, ctx.topology
    algo, kl, run = cfg.algo, cfg.kl, cfg.train
    if cfg.model.moe.enabled and cfg.parallel.expert_parallel > 1:
        batch = common_width(batch, groups.dp_group)
    sampling = cfg.rollout.sampling
    vocab = pipeline.VocabOptions.for_model(
        cfg.model, cfg.parallel, sampling.logprob_temperature, sampling.trained_truncation(cfg.model.vocab_size)
    )
    mask = batch.loss_mask
    timings = {}
    # the engine's routing (None without): replayed by the policy, compared by the metrics
    sequences = pipeline.SequenceBatch(batch.tokens, mask, routed_experts=batch.routed_experts)
    if batch.routed_experts is None and cfg.model.moe.routing_replay == "rollout":
        raise CorruptResponse(
            f"step {step}: model.moe.routing_replay=rollout but the rollout batch carries no routing "
            f"(rollout.engine={cfg.rollout.engine} returned completions without routed experts)"
        )
    scores = _scoring_passes(ctx, sequences, step, vocab, timings)
    reference, old, teacher = scores.reference, scores.old, scores.teacher
    distill = cfg.distill.kl if teacher is not None else None
    # sampled tokens outside the trainer's support are an error before anything is updated (recomputed pi_old)
    support = support_metrics(batch, old, step, sampling, groups.dp_group) if old is not None else None

    ctx.clamps.counts.clear()
    task_rewards = batch.rewards if cfg.distill.task_reward == "keep" else torch.zeros_like(batch.rewards)
    advantages = sequence_advantages(
        task_rewards, run.group_size, algo.advantage, algo.std_normalize, valid=batch.reward_valid
    )
    zeros = torch.zeros(mask.shape, dtype=torch.float32)
    inputs = LossInputs(
        loss_mask=mask,
        behavior_logprobs=batch.behavior_logprobs,
        reference_logprobs=reference.logprobs if reference is not None else zeros,  # unread: no KL
        advantages=advantages[:, None] * mask,
        teacher_logprobs=teacher.logprobs if teacher is not None else None,
        teacher_top_logprobs=scores.teacher_top_logprobs,
    )
    if old is not None:
        no_reward = torch.zeros_like(batch.rewards)
        returns = torch.zeros(mask.shape, dtype=old.logprobs.dtype)
        if reference is not None and (teacher is None or kl.coef > 0):  # the pi_old pass's exact KL to the
            # reference: its kl without distillation, its regularizer_kl beside the teacher's
            returns = kl_shaped_returns(
                kl,
                no_reward,
                old.logprobs,
                reference.logprobs,
                mask,
                batch.behavior_logprobs,
                full_kl=old.kl if teacher is None else old.regularizer_kl,
                counter=ctx.clamps,
            )
        inputs = dataclasses.replace(inputs, old_logprobs=old.logprobs, kl_returns=returns)
        if distill is not None:
            per_position = old.kl
            if scores.teacher_top_logprobs is not None:
                per_position = teacher_top_k_divergence(
                    cfg, old, scores.teacher_top_logprobs, mask, TermCounter(ctx.clamps, "distill")
                )
            inputs = dataclasses.replace(
                inputs,
                distill_returns=kl_shaped_returns(
                    distill.per_position(),
                    no_reward,
                    old.logprobs,
                    teacher.logprobs,
                    mask,
                    batch.behavior_logprobs,
                    full_kl=per_position,
                    counter=TermCounter(ctx.clamps, "distill"),
                ),
            )
    sequences = inputs.into(sequences)
    # the update's forward needs the exact KL for a full KL in the loss, and to be pi_old's stats (from_update)
    term = anchor_objective(cfg)
    exact_in_loss = term.exact and term.placement == "loss" and term.coef > 0
    anchor = teacher if teacher is not None else reference
    regularizer_in_loss = scores.regularizing and kl.placement == "loss" and kl.coef > 0
    needs_head = anchor is not None and scores.exact and (exact_in_loss or regularizer_in_loss or old is None)

    with phase("update", timings), _recording(ctx) if cfg.algo.old_logprobs == "from_update" else nullcontext():
        metrics, captured = _update(
            ctx, sequences, step, vocab, ctx.exact_heads(scores.regularizing) if needs_head else None
        )
    old = old if old is not None else captured

    if reference is not None:
        metrics.update(
            kl_metrics(old.logprobs, reference.logprobs, old.kl if teacher is None else old.regularizer_kl, mask)
        )
    if teacher is not None:
        metrics.update(kl_metrics(old.logprobs, teacher.logprobs, old.kl, mask, prefix="distill"))
        if scores.teacher_top_logprobs is not None and old.candidate_logprobs is not None:
            top_k = teacher_top_k_divergence(cfg, old, scores.teacher_top_logprobs, mask)
            metrics["distill/topk_token"] = _masked_mean(top_k, mask)
            metrics["distill/topk_sequence"] = float(top_k.sum(-1).mean())
    metrics["entropy/mean"] = _masked_mean(old.entropy, mask)
    metrics.update(rollout_metrics(batch, old.logprobs, step))
    metrics.update(replay_metrics(scores.unreplayed, batch))
    metrics.update(support if support is not None else support_metrics(batch, old, step, sampling, groups.dp_group))
    if run.micro_batch_tokens > 0:  # what the scoring passes see: each microbatch padded to its own longest row
        token_groups = sequences.token_groups(run.micro_batch_tokens)
        metrics["batch/padded_tokens"] = float(sum(len(rows) * width for rows, width in token_groups))
        metrics["batch/microbatches"] = float(len(token_groups))
    metrics.update(context_parallel.sum_counts(ctx.clamps.as_dict(), groups.cp_group))
    metrics = _reduce(metrics, groups.dp_group)
    if ctx.expert_load is not None:  # counts summed over data-parallel ranks, pipeline stages and, with sequence
        # parallelism (each TP rank routes its share of the tokens), tensor-parallel ranks
        summed_over = (groups.dp_group, groups.pp_group)
        summed_over += (groups.tp_group,) if cfg.parallel.sequence_parallel else ()
        metrics.update(ctx.expert_load.metrics(summed_over, cfg.model.moe.capacity_factor is not None))
    metrics.update(ctx.kl_tags)
    metrics.update(timings)
    return metrics
