"""Every metric key the trainer logs (metrics.jsonl, TensorBoard, W&B): its unit, its meaning and when it is
logged. ``docs/metrics.md`` is generated from :data:`METRICS` (``python -m megatron_kl.train.metric_registry``)
and a test fails when a logged key is not registered or the document is stale.

Keys with ``<...>`` are families: ``<split>`` is an evaluation split (``id`` in-domain, ``ood`` out of
distribution, ``id:<file>`` / ``ood:<file>`` one benchmark file of a math task), ``<k>`` is ``eval.k``,
``<estimator>`` one of k1/k3/exact, ``<phase>`` a timed phase of the step, ``<what>`` what a clamp applied to.

Keys renamed since earlier versions are in :data:`RENAMED`; :func:`canonical_record` reads a record written with
either spelling (the study report and plots use it, so old run directories stay readable).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    unit: str
    meaning: str
    when: str = "every step"


_REF = "every step with reference work (train.reference_metrics_interval)"
METRICS = (
    Metric(
        "step",
        "step",
        "the RL step of the record (0-based); an evaluation after the last step has step = train.steps",
        "every record",
    ),
    Metric("reward/mean", "reward", "mean task reward of the step's samples"),
    Metric("reward/std", "reward", "standard deviation of the step's rewards"),
    Metric("reward/accuracy", "fraction", "fraction of samples whose answer verified (reward >= 1)"),
    Metric(
        "reward/fn/<label>",
        "reward",
        "mean of one reward function's value over the scored samples (before its weight)",
        "with several reward.functions",
    ),
    Metric(
        "reward/extra/<name>",
        "value",
        "mean of a named extra value reward functions returned (RewardResult.metrics, a service's metrics)",
        "when a reward function returns it",
    ),
    Metric(
        "reward/failed",
        "count",
        "samples of this data-parallel rank whose reward call failed (mean over ranks); "
        "with reward.on_failure=exclude they are left out of the baseline and the loss",
    ),
    Metric("reward/failed_fraction", "fraction", "fraction of the step's samples whose reward call failed"),
    Metric("response/length_mean", "tokens", "mean response length"),
    Metric(
        "response/stopped_fraction",
        "fraction",
        "fraction of responses that ended at a stop token (not the length limit)",
    ),
    Metric("batch/tokens", "tokens", "prompt + response tokens of the batch on this data-parallel rank"),
    Metric("batch/padded_tokens", "tokens", "the same padded to the longest sequence (what the training passes see)"),
    Metric(
        "batch/microbatches",
        "count",
        "microbatches of the update (with train.micro_batch_tokens)",
        "with a token budget",
    ),
    Metric("loss/total", "loss", "the optimised loss (policy loss + KL term in the loss)"),
    Metric("loss/policy", "loss", "the policy-gradient (PPO/GRPO/RPG) part of the loss"),
    Metric("loss/kl_term", "loss", "beta x the KL term added to the loss (0 when the KL is in the reward)"),
    Metric("entropy/mean", "nats/token", "mean per-token entropy of the policy on the sampled responses"),
    Metric(
        "kl/<estimator>_token",
        "nats/token",
        "mean per-token KL(pi || pi_ref) estimate: k1, k3, or exact "
        "(full vocabulary; under distillation with kl.estimator=full, a second sweep beside the teacher's)",
        _REF,
    ),
    Metric("kl/<estimator>_sequence", "nats/sequence", "mean per-sequence sum of the KL estimate", _REF),
    Metric(
        "kl/biased",
        "0/1",
        "1 when the configured KL term's expected gradient is biased for kl.target (audit verdict, docs/kl-math.md)",
        "every step with a KL term",
    ),
    Metric(
        "distill/<estimator>_token",
        "nats/token",
        "mean per-token KL(pi || pi_teacher) estimate: k1, k3, exact "
        "(full vocabulary, to the teacher; a loaded teacher only), or topk (the "
        "top-k divergence of distill.kl.estimator=topk, its distill.kl.top_k_tail form: an approximation)",
        "every step with distillation",
    ),
    Metric(
        "distill/<estimator>_sequence",
        "nats/sequence",
        "mean per-sequence sum of the KL-to-teacher estimate",
        "every step with distillation",
    ),
    Metric(
        "distill/biased",
        "0/1",
        "1 when the distillation term's expected gradient is biased for distill.kl.target "
        "(audit verdict, docs/distillation.md)",
        "every step with a weighted distillation term",
    ),
    Metric(
        "distill/clamped_<what>",
        "count",
        "log-ratio entries of the distillation term clamped to distill.kl.clamp "
        "before an exp (k2/k3 terms, token importance weights, prefix weights); topk_tail: positions whose teacher "
        "rest mass (1 - its top-k mass) was below 1e-12 and floored there",
        "when something was clamped",
    ),
    Metric(
        "loss/distill_term",
        "loss",
        "coef x the distillation term added to the loss (a surrogate whose gradient "
        "is the term's; in the reward placement the credited penalty's surrogate)",
        "with distillation",
    ),
    Metric(
        "kl/clamped_<what>",
        "count",
        "log-ratio entries of a KL term clamped to kl.clamp before an exp (k2/k3 "
        "terms, token importance weights, prefix weights)",
        "when something was clamped",
    ),
    Metric("policy/clip_fraction", "fraction", "fraction of tokens whose PPO ratio was clipped"),
    Metric(
        "policy/ratio_max",
        "ratio",
        "largest PPO ratio pi / pi_old of the step (the trainer's policy moving "
        "away from the weights that produced the old log-probs; is/ratio_max is the sampler's gap)",
    ),
    Metric(
        "policy/clamped_ratio", "count", "PPO log-ratios clamped to +-20 before the exp", "when something was clamped"
    ),
    Metric("rpg/clip_fraction", "fraction", "fraction of tokens clipped by RPG's dual clip", "algo.loss=rpg"),
    Metric("rpg/kl_coefficient", "coefficient", "RPG's KL coefficient", "algo.loss=rpg"),
    Metric("rpg/kl_term", "loss", "RPG's KL part of the loss", "algo.loss=rpg"),
    Metric(
        "rpg/clamped_<what>",
        "count",
        "RPG log-ratios (w = pi / pi_old, u = pi_ref / pi_old) clamped to kl.clamp",
        "algo.loss=rpg, when something was clamped",
    ),
    Metric(
        "is/ratio_mean",
        "ratio",
        "mean over response tokens of w = pi_old / mu (trainer's old policy vs the sampler's log-probs)",
    ),
    Metric("is/ratio_min", "ratio", "smallest importance ratio pi_old / mu"),
    Metric("is/ratio_max", "ratio", "largest importance ratio pi_old / mu"),
    Metric(
        "correction/weight_mean",
        "weight",
        "mean behaviour-correction weight (algo.behavior_correction)",
        "with a behaviour correction",
    ),
    Metric(
        "correction/truncated_fraction",
        "fraction",
        "fraction of weights truncated (TIS)",
        "with a behaviour correction",
    ),
    Metric("correction/masked_fraction", "fraction", "fraction of tokens masked (MIS)", "with a behaviour correction"),
    Metric(
        "correction/clamped_ratio",
        "count",
        "behaviour log-ratios log pi_old - log mu clamped before the exp",
        "when something was clamped",
    ),
    Metric(
        "mismatch/abs_logprob_mean",
        "nats",
        "mean |log pi_train - log mu_rollout| per token (train-vs-rollout "
        "mismatch; ~0 on-policy; large when rollout.sampling.distribution=full with top-k/top-p: the engines "
        "report log mu of the truncated distribution)",
    ),
    Metric("mismatch/abs_logprob_max", "nats", "largest |log pi_train - log mu_rollout|"),
    Metric(
        "moe/tokens_per_expert_max",
        "tokens",
        "most tokens a router sent to one expert in one layer, summed "
        "over data-parallel ranks, in the pass that computes pi_old (with algo.old_logprobs=from_update: every "
        "forward of the update); padding counts too, except where the engine reports its routing (then only the "
        "tokens it routed)",
        "mixture-of-experts models",
    ),
    Metric(
        "moe/tokens_per_expert_min",
        "tokens",
        "fewest tokens of one expert in one layer (as the max)",
        "mixture-of-experts models",
    ),
    Metric(
        "moe/tokens_per_expert_mean",
        "tokens",
        "mean tokens per expert and layer (tokens x router_topk / experts without drops)",
        "mixture-of-experts models",
    ),
    Metric(
        "moe/load_imbalance",
        "ratio",
        "moe/tokens_per_expert_max / moe/tokens_per_expert_mean (1: balanced)",
        "mixture-of-experts models",
    ),
    Metric(
        "moe/dropped_fraction",
        "fraction",
        "routes (token, expert) dropped by the capacity factor over tokens x router_topk",
        "model.moe.capacity_factor set",
    ),
    Metric(
        "moe/routing_agreement",
        "fraction",
        "of the experts the rollout engine routed each token to, the share "
        "the trainer's routers pick by themselves in the pass that computes pi_old (own top-k of own logits, "
        "whether or not routing replay overrides it), over prompt and response tokens and layers: 1 when engine "
        "and trainer route alike; below 1 the trainer without model.moe.routing_replay=rollout scores another "
        "network than the one that sampled (see mismatch/abs_logprob_mean)",
        "mixture-of-experts models whose engine reports its routing (local always; sglang with routing replay)",
    ),
    Metric(
        "moe/mismatch_without_replay",
        "nats",
        "mean |log pi_old - log mu_rollout| over response tokens with the "
        "trainer's own routing (the pi_old pass once more with replay off), next to the replayed mismatch/"
        "abs_logprob_mean: what routing replay removes",
        "model.moe.routing_replay=rollout, every train.reference_metrics_interval steps",
    ),
    Metric(
        "sampling/truncated_mass",
        "probability",
        "mean over response tokens of 1 - the top-k/top-p support's "
        "mass under the full softmax(z / T): how much the engines' truncation cuts away",
        "with top-k/top-p and rollout.sampling.distribution=truncated",
    ),
    Metric(
        "sampling/support_size",
        "tokens",
        "mean size of the truncated support at the response tokens",
        "with top-k/top-p and rollout.sampling.distribution=truncated",
    ),
    Metric(
        "sampling/outside_support",
        "fraction",
        "response tokens outside the trainer's support (stale rows "
        "legitimately; fresh rows only by rounding, an error above rollout.sampling.support_tolerance)",
        "with top-k/top-p and rollout.sampling.distribution=truncated",
    ),
    Metric("mismatch/k1_token", "nats/token", "k1 estimate of KL(mu || pi_train) per token"),
    Metric("mismatch/k3_token", "nats/token", "k3 estimate of KL(mu || pi_train) per token"),
    Metric("staleness/mean", "steps", "mean age of the weights that generated the batch (async rollouts)"),
    Metric("staleness/max", "steps", "oldest weights in the batch"),
    Metric(
        "weight_sync/full",
        "flag",
        "1 when the step's weight sync sent every tensor (the first sync, "
        "rollout.delta_sync=false, or a fallback: restart, version gap, checksum mismatch)",
        "every step (trainer rank 0)",
    ),
    Metric(
        "weight_sync/bytes",
        "bytes",
        "bytes the step's weight sync sent (delta sync: changed elements as int32 "
        "index + value, or changed tensors whole); the embedded engine counts this rank's shards",
        "every step (trainer rank 0)",
    ),
    Metric(
        "weight_sync/bytes_full", "bytes", "bytes a full sync of the same weights sends", "every step (trainer rank 0)"
    ),
    Metric("weight_sync/changed_tensors", "fraction", "tensors the sync sent, of all", "every step (trainer rank 0)"),
    Metric(
        "weight_sync/changed_elements",
        "fraction",
        "elements the sync sent, of all (changed bits since the engine's version with rollout.delta_sync)",
        "every step (trainer rank 0)",
    ),
    Metric(
        "staleness/token_mean",
        "steps",
        "mean age of the weights that sampled each response token (partial "
        "rollouts: a response can span several weight versions)",
    ),
    Metric("staleness/token_max", "steps", "oldest weights that sampled any response token (<= train.staleness)"),
    Metric(
        "staleness/older_token_fraction", "fraction", "response tokens sampled by weights older than the step's policy"
    ),
    Metric(
        "staleness/mixed_response_fraction",
        "fraction",
        "responses whose tokens come from more than one weight "
        "version (resumed across a weight update: rollout.partial)",
    ),
    Metric(
        "optim/grad_norm",
        "norm",
        "global gradient norm before clipping (mean over the RL step's applied optimizer steps)",
    ),
    Metric("optim/lr", "lr", "learning rate of the RL step's last optimizer step"),
    Metric(
        "optim/steps",
        "count",
        "optimizer steps applied since the run started (an RL step runs "
        "algo.ppo_epochs x algo.minibatches of them; the LR schedule counts these)",
    ),
    Metric(
        "optim/skipped_updates", "count", "optimizer steps of this RL step skipped because a gradient was not finite"
    ),
    Metric("health/nonfinite_metrics", "count", "metric values that were NaN/inf and logged as null"),
    Metric("throughput/response_tokens", "tokens", "response tokens trained this step, all data-parallel ranks"),
    Metric("throughput/tokens_per_s", "tokens/s", "response tokens per second of training (evaluation time excluded)"),
    Metric("time/step", "s", "wall time of the step, evaluation included"),
    Metric(
        "time/rollout",
        "s",
        "generation time of the step's batch (async: spent in the background while "
        "earlier steps trained, so it can exceed time/rollout_wait)",
    ),
    Metric(
        "time/<phase>",
        "s",
        "wall time of a phase of the step: rollout_wait (how long the trainer waited for the "
        "batch: time/rollout on-policy, ~0 when async generation keeps up), reference, teacher "
        "(distillation), old_logprobs, unreplayed_logprobs (routing replay's metric pass), update, weight_sync",
    ),
    Metric("time/eval", "s", "wall time of the evaluation", "every eval.interval steps, before and after training"),
    Metric(
        "eval/<split>/pass@1",
        "fraction",
        "greedy accuracy on the split (id: in-domain, ood: out of distribution)",
        "every eval.interval steps, before and after training",
    ),
    Metric(
        "eval/<split>/mean@<k>",
        "fraction",
        "mean accuracy of eval.k samples per problem at eval.temperature",
        "every eval.interval steps, before and after training",
    ),
    Metric(
        "eval/<split>/reward_failed",
        "count",
        "evaluation responses whose reward call failed (scored 0, reward.on_failure=exclude)",
        "when a reward call failed in an evaluation",
    ),
)


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"<[a-z]+>", r"[A-Za-z0-9_.-]+", re.escape(key)) + "$")  # escape keeps <>


_PATTERNS = [(m, _pattern(m.key)) for m in METRICS]

# old key -> new key (exact names); the in-domain split was called ``eval`` (``eval/eval/pass@1``)
RENAMED = {
    "grad_norm": "optim/grad_norm",
    "lr": "optim/lr",
    "train/skipped_updates": "optim/skipped_updates",
    "kl/clamped_ppo_ratio": "policy/clamped_ratio",
    "kl/clamped_behavior_ratio": "correction/clamped_ratio",
    "kl/clamped_rpg_w": "rpg/clamped_w",
    "kl/clamped_rpg_u": "rpg/clamped_u",
}
_OLD_IN_DOMAIN = re.compile(r"^eval/eval(?=[/:])")


def canonical_key(key: str) -> str:
    """The current name of a metric key written by any version (unchanged when it is current)."""
    return RENAMED.get(key) or _OLD_IN_DOMAIN.sub("eval/id", key)


def canonical_record(record: dict) -> dict:
    """A metrics record with every key under its current name (a key present in both spellings keeps the
    current one's value)."""
    out = {}
    for key, value in record.items():
        new = canonical_key(key)
        if new == key or new not in record:
            out[new] = value
    return out


def lookup(key: str):
    """The registry entry a logged key belongs to, or None."""
    return next((m for m, pattern in _PATTERNS if pattern.match(key)), None)


def markdown() -> str:
    lines = [
        "# Metrics",
        "",
        "Generated from `megatron_kl/train/metric_registry.py` (`python -m megatron_kl.train.metric_registry > "
        "docs/metrics.md`); every key the trainer logs to `metrics.jsonl`, TensorBoard and W&B is here (tested).",
        "`<...>` marks a family of keys.",
        "",
        "| key | unit | meaning | logged |",
        "|---|---|---|---|",
    ]
    for m in METRICS:
        lines.append(f"| `{m.key}` | {m.unit} | {m.meaning.replace('|', '/')} | {m.when} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
