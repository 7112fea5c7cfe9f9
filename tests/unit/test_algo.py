"""Advantage estimators, PPO clipping, exact microbatch shares, sampling filters, batching."""

import pytest
import torch

from megatron_kl.algo.advantages import sequence_advantages
from megatron_kl.algo.losses import AlgoConfig, Shares, microbatch_loss, ppo_loss
from megatron_kl.config import ConfigError
from megatron_kl.kl.objective import KLConfig
from megatron_kl.rollout.engine import SamplingConfig
from megatron_kl.rollout.local import filter_logits, sample_tokens
from megatron_kl.train.batching import pack
from megatron_kl.vocab_parallel.stats import VocabParallelStats


def test_advantages_match_float64_formulas():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(12, generator=g, dtype=torch.float64)
    groups = r.view(3, 4)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, unbiased=False, keepdim=True)
    torch.testing.assert_close(sequence_advantages(r, 4, "grpo"), ((groups - mean) / (std + 1e-6)).flatten())
    torch.testing.assert_close(sequence_advantages(r, 4, "grpo", std_normalize=False), (groups - mean).flatten())
    loo = torch.stack(
        [torch.stack([groups[i, j] - (groups[i].sum() - groups[i, j]) / 3 for j in range(4)]) for i in range(3)]
    ).flatten()
    torch.testing.assert_close(sequence_advantages(r, 4, "rloo"), loo)
    torch.testing.assert_close(
        sequence_advantages(r, 4, "reinforce_pp"), (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    )
    c = (groups - mean).flatten()
    torch.testing.assert_close(
        sequence_advantages(r, 4, "reinforce_pp_baseline"), (c - c.mean()) / (c.std(unbiased=False) + 1e-6)
    )
    with pytest.raises(ConfigError, match="algo.advantage"):
        sequence_advantages(r, 4, "gae")


def test_ppo_clip_and_dual_clip_gradients():
    cfg = AlgoConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    old = torch.zeros(1, 4, dtype=torch.float64)
    # ratios 1.5 (A>0: clipped), 0.5 (A<0: clipped), 5.0 (A<0: dual clipped), 1.1 (A>0: free)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 5.0, 1.1]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, clipped, _ = ppo_loss(logprobs, old, adv, mask, cfg)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.28, 0.8, 3.0, -2.2]], dtype=torch.float64))
    assert clipped.tolist() == [[True, True, True, False]]
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0, -2.2]], dtype=torch.float64))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
@pytest.mark.parametrize(
    "kl",
    [
        KLConfig(estimator="k3", placement="loss", coef=0.1, aggregation="token_mean"),
        KLConfig(estimator="k1", placement="reward", coef=0.1),
        KLConfig(estimator="full", placement="loss", level="sequence", coef=0.1),
    ],
)
def test_microbatch_shares_add_up_to_the_minibatch_loss_and_gradient(aggregation, kl):
    from megatron_kl.models.batch import SequenceBatch

    g = torch.Generator().manual_seed(1)
    b, t = 6, 5
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[:, 0] = 1
    logprobs = (-torch.rand(b, t, generator=g, dtype=torch.float64)).requires_grad_()
    full_kl = torch.rand(b, t, generator=g, dtype=torch.float64).requires_grad_()
    batch = SequenceBatch(
        torch.zeros(b, t + 1, dtype=torch.long),
        mask,
        old_logprobs=logprobs.detach() - 0.05,
        behavior_logprobs=logprobs.detach() - 0.1,
        reference_logprobs=logprobs.detach() + 0.2,
        advantages=torch.randn(b, 1, generator=g, dtype=torch.float64) * mask,
        kl_returns=-0.1 * torch.rand(b, t, generator=g, dtype=torch.float64) * mask,
    )
    algo = AlgoConfig(aggregation=aggregation, entropy_coef=0.01)
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64)

    def run(rows, shares):
        stats = VocabParallelStats(logprobs=logprobs[rows], entropy=entropy[rows], kl=full_kl[rows])
        (mb,) = batch.select(torch.arange(b)[rows]).split(1)
        return microbatch_loss(stats, mb, algo, kl, shares)[0]

    everything = slice(0, b)
    whole = run(everything, Shares(b, float(mask.sum())))
    grads_whole = torch.autograd.grad(whole, (logprobs, full_kl), allow_unused=True)
    shares = Shares(b, float(mask.sum()))
    parts = run(slice(0, 2), shares) + run(slice(2, 6), shares)
    grads_parts = torch.autograd.grad(parts, (logprobs, full_kl), allow_unused=True)
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    assert grads_whole[0] is not None and grads_whole[0].abs().sum() > 0
    assert (grads_whole[1] is not None) == (kl.estimator == "full")
    for a, c in zip(grads_parts, grads_whole):
        if c is not None:
            torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_algo_config_errors():
    for kwargs, field in (
        ({"advantage": "gae"}, "algo.advantage"),
        ({"loss": "dpo"}, "algo.loss"),
        ({"dual_clip": 0.5}, "algo.dual_clip"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"behavior_correction": "vtrace"}, "behavior_correction"),
    ):
        with pytest.raises(ConfigError, match=field):
            AlgoConfig(**kwargs)


@pytest.mark.parametrize("top_k", [18, 0], ids=["top-k", "unfiltered-one-pass"])
def test_sampler_draws_the_tempered_filtered_distribution_over_a_large_vocabulary(top_k):
    """Inverse-CDF sampling: Pearson chi-square against the exact probabilities over 20 categories that carry
    the mass of a 4099-word vocabulary (the rest below 1e-9, never drawn), tokens removed by top-k never drawn,
    the first and last vocabulary entries reachable."""
    vocab, rows = 4099, 40000
    logits = torch.full((vocab,), -40.0)
    support = torch.tensor([7, 100, 0, 1, 2048, 4000, 4097, 4098] + list(range(3000, 3012)))  # 7, 100: top-k cut
    logits[support] = torch.linspace(0.0, 3.0, len(support))
    sampling = SamplingConfig(temperature=0.7, top_k=top_k)
    probs = torch.softmax(filter_logits(logits[None] / 0.7, sampling.top_k, 1.0), -1)[0].double()
    tokens, logprobs = sample_tokens(
        logits.repeat(rows, 1),
        sampling,
        torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(3)),
    )
    counts = torch.bincount(tokens, minlength=vocab).double()
    kept = probs > 1e-9  # the support (the rest has probability < 1e-20 and is never drawn)
    assert counts[~kept].sum() == 0  # the two top-k casualties (with top-k) and every improbable token
    assert int(kept.sum()) == (18 if top_k else 20)
    expected = rows * probs[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 48.0, chi2  # 17 or 19 degrees of freedom: P(chi2 > 48) < 3e-4
    # behaviour log-probs of the distribution that sampled: the tempered, truncated and renormalised one
    expected_logprobs = torch.log_softmax(filter_logits(logits[None] / 0.7, sampling.top_k, 1.0), -1)[0][tokens]
    torch.testing.assert_close(logprobs, expected_logprobs)
    if top_k:  # with top-k they differ from the full softmax's by the log of the kept mass
        full = torch.log_softmax(logits / 0.7, -1)[tokens]
        assert float((logprobs - full).min()) > 1e-3
    assert counts[0] > 0 and counts[4098] > 0


def test_top_k_top_p_filters_match_a_direct_computation():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.8))
    assert kept.tolist() == [[True, True, True, False, False]]  # 0.5+0.2 < 0.8 <= 0.5+0.2+0.15
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.3)).tolist() == [[True, False, False, False, False]]


def test_sampling_frequencies_and_behaviour_logprobs():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).repeat(20000, 1)
    tokens, logprobs = sample_tokens(
        logits,
        SamplingConfig(temperature=1.0),
        torch.rand(len(logits), dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
    )
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.015)
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])
    greedy, _ = sample_tokens(logits[:3], SamplingConfig(temperature=0.0), torch.rand(3, dtype=torch.float64))
    assert greedy.tolist() == [0, 0, 0]
    with pytest.raises(ConfigError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_pack_aligns_mask_and_per_token_values_with_targets():
    tokens, mask, values = pack([[1, 2, 3], [1, 4]], [[5, 6], [7]], pad_id=0, per_token=[[-0.5, -0.25], [-1.0]])
    assert tokens.tolist() == [[1, 2, 3, 5, 6], [1, 4, 7, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert values.tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, 0, 0]]


def test_old_logprobs_from_update_needs_one_epoch_of_one_minibatch():
    from megatron_kl.algo.losses import AlgoConfig, row_separable
    from megatron_kl.config import ConfigError
    from megatron_kl.kl import KLConfig

    assert AlgoConfig(old_logprobs="from_update", minibatches=1).old_logprobs == "from_update"
    for kwargs in ({"minibatches": 2}, {"minibatches": 1, "ppo_epochs": 2}):
        with pytest.raises(
            ConfigError, match="algo.old_logprobs=from_update .*algo.ppo_epochs=1 and algo.minibatches=1"
        ):
            AlgoConfig(old_logprobs="from_update", **kwargs)
    with pytest.raises(ConfigError, match=r"algo.old_logprobs='again' must be one of \['recompute', 'from_update'\]"):
        AlgoConfig(old_logprobs="again")
    # pi_old is the row's own detached stats: still row-separable unless a weight or credit reads other rows
    from_update = dict(old_logprobs="from_update", minibatches=1)
    in_loss = KLConfig(estimator="k3", placement="loss", level="token", coef=0.1)
    assert row_separable(in_loss, AlgoConfig(**from_update))
    assert row_separable(in_loss, AlgoConfig(**from_update, behavior_correction="token_tis"))
    assert row_separable(in_loss, AlgoConfig(**from_update, behavior_correction="icepop"))
    assert not row_separable(in_loss, AlgoConfig(**from_update, behavior_correction="sequence_tis"))
    assert not row_separable(in_loss, AlgoConfig(**from_update, behavior_correction="geometric_mask"))
    assert not row_separable(KLConfig(coef=0.1, placement="reward"), AlgoConfig(**from_update))
    assert row_separable(KLConfig(coef=0.1, placement="reward"), AlgoConfig(minibatches=1))
    assert row_separable(KLConfig(), AlgoConfig(minibatches=1))


def test_token_budget_split_covers_every_row_once_within_the_budget():
    """SequenceBatch.split(token_budget): every row in exactly one microbatch, rows x width <= budget unless a
    single row is longer, no response token cut off, the carried tensors cut with their rows and columns."""
    from megatron_kl.models.pipeline import SequenceBatch, scatter_rows

    g = torch.Generator().manual_seed(5)
    rows, width = 23, 30
    tokens = torch.randint(0, 100, (rows, width), generator=g)
    mask = torch.zeros(rows, width - 1)
    for i in range(rows):
        start = int(torch.randint(1, 10, (), generator=g))
        end = int(torch.randint(start, width, (), generator=g))  # end == start: no response token
        mask[i, start:end] = 1
    per_position = torch.randn(rows, width - 1, generator=g)
    hidden = torch.randn(rows, width, 4, generator=g)
    batch = SequenceBatch(tokens, mask, advantages=per_position, reference_hidden=hidden)
    lengths = batch.lengths()
    for budget in (1, 29, 64, 200, 10**6):
        plan = batch.split(1, budget)
        groups = batch.token_groups(budget)  # the same plan without cutting tensors (batch/padded_tokens)
        assert [(mb.rows.tolist(), mb.tokens.shape[1]) for mb in plan] == [(r.tolist(), w) for r, w in groups]
        assert [mb.index for mb in plan] == list(range(len(plan)))
        seen = torch.cat([mb.rows for mb in plan])
        assert sorted(seen.tolist()) == list(range(rows))
        for mb in plan:
            count, cut = mb.tokens.shape
            assert count * cut <= budget or count == 1
            assert cut == int(lengths[mb.rows].max())
            torch.testing.assert_close(mb.tokens, tokens[mb.rows, :cut])
            torch.testing.assert_close(mb.advantages, per_position[mb.rows, : cut - 1])
            torch.testing.assert_close(mb.reference_hidden, hidden[mb.rows, :cut])
            assert mb.old_logprobs is None  # not carried by the batch: not invented
            assert mb.loss_mask.sum() == mask[mb.rows].sum()  # nothing of a response was cut
        assembled = scatter_rows(
            [mb.advantages * mb.loss_mask for mb in plan], [mb.rows for mb in plan], tuple(mask.shape)
        )
        torch.testing.assert_close(assembled, per_position * mask)
    equal = batch.split(1)[0]  # without a budget: the rows whole, every tensor a view of the batch's
    assert equal.tokens.data_ptr() == tokens.data_ptr() and torch.equal(equal.reference_hidden, hidden)
    with pytest.raises(AttributeError):
        batch.reference_hiden = hidden  # a misspelt name is an error where it is written
    assert len(batch.split(1, 10**6)) == 1 and len(batch.split(1, 1)) == rows


def test_all_finite_finds_every_kind_of_non_finite_entry():
    """optim._all_finite (the skip-step check over whole gradient buffers) against isfinite().all()."""
    from megatron_kl.models.optim import _all_finite

    g = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=g) * 1e30  # large but finite: no overflow in the check
    assert _all_finite(values) and _all_finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 4321, 9_999):
            poisoned = values.clone()
            poisoned[where] = bad
            assert not _all_finite(poisoned), (bad, where)
            assert not _all_finite(poisoned.to(torch.bfloat16)), (bad, where)


def test_position_draws_follow_the_forcing_schemes_stream():
    """Row i's t-th response token takes the uniform the forcing scheme gives it (frame step len_i - min + t of
    one row-vector per step), and a generator used by the ragged scheme ends where the forcing scheme leaves it."""
    from megatron_kl.rollout.local import PositionDraws

    prompt_len = torch.tensor([3, 7, 4, 3])
    stream = torch.rand(20, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    draws = PositionDraws(torch.Generator().manual_seed(9), prompt_len, 9, random=True)
    active = torch.tensor([True, True, True, False])
    for t in range(3):
        got = draws.response(t, active)
        for i in (0, 1, 2):
            assert got[i] == stream[int(prompt_len[i]) - 3 + t, i]
    assert draws.drawn_steps == 7 - 3 + 2 + 1  # as far as the active rows needed: the forcing scheme's step count
    forcing = PositionDraws(torch.Generator().manual_seed(9), prompt_len, 9, random=True)
    assert all(torch.equal(forcing.frame(k), stream[k]) for k in range(7))
    assert torch.equal(draws.generator.get_state(), forcing.generator.get_state())
    greedy = PositionDraws(torch.Generator().manual_seed(9), prompt_len, 9, random=False)
    assert not greedy.response(0, active).any() and greedy.drawn_steps == 0


def test_loss_inputs_travel_by_name_and_a_missing_one_is_named():
    from megatron_kl.algo.losses import LossInputs
    from megatron_kl.models.batch import SequenceBatch

    mask = torch.ones(2, 3)
    inputs = LossInputs(
        loss_mask=mask,
        behavior_logprobs=torch.randn(2, 3),
        reference_logprobs=torch.randn(2, 3),
        advantages=torch.randn(2, 3),
        old_logprobs=torch.randn(2, 3),
    )
    batch = inputs.into(SequenceBatch(torch.zeros(2, 4, dtype=torch.long), mask))
    assert set(batch.row_tensors()) == {"behavior_logprobs", "reference_logprobs", "advantages", "old_logprobs"}
    (mb,) = batch.split(1)
    back = LossInputs.from_microbatch(mb)
    assert back.kl_returns is None and all(torch.equal(getattr(back, k), v) for k, v in batch.row_tensors().items())
    mb.reference_logprobs = None
    with pytest.raises(ValueError, match="reference_logprobs"):
        LossInputs.from_microbatch(mb)


def test_the_distillation_term_adds_its_own_loss_and_files_its_own_clamps():
    """Two KL terms in one microbatch: the distillation term (k3 to the teacher, far away: its log-ratios clamped)
    adds kl_loss's value with log pi_teacher in log pi_ref's place, logged as loss/distill_term; its clamps are
    distill/clamped_*, the reference term's kl/clamped_*."""
    from megatron_kl.kl.estimators import ClampCounter
    from megatron_kl.kl.objective import kl_loss
    from megatron_kl.models.batch import SequenceBatch

    g = torch.Generator().manual_seed(2)
    b, t = 4, 5
    mask = torch.ones(b, t, dtype=torch.float64)
    logprobs = (-torch.rand(b, t, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = logprobs.detach() - 30.0  # |d| = 30 > the clamp at 20
    zeros = torch.zeros(b, t, dtype=torch.float64)
    batch = SequenceBatch(
        torch.zeros(b, t + 1, dtype=torch.long),
        mask,
        old_logprobs=logprobs.detach(),
        behavior_logprobs=logprobs.detach(),
        reference_logprobs=logprobs.detach() + 0.1,
        advantages=zeros,
        kl_returns=zeros,
        teacher_logprobs=teacher,
        distill_returns=zeros,
    )
    reference_term = KLConfig(estimator="k3", placement="loss", coef=0.1, aggregation="token_mean")
    distill = KLConfig(estimator="k3", placement="loss", coef=0.5, aggregation="token_mean")
    stats = VocabParallelStats(logprobs=logprobs, entropy=zeros, kl=None)
    (mb,) = batch.split(1)
    counter = ClampCounter()
    total, metrics = microbatch_loss(
        stats,
        mb,
        AlgoConfig(aggregation="token_mean"),
        reference_term,
        Shares(b, float(mask.sum())),
        counter,
        distill=distill,
    )
    expected = kl_loss(distill, logprobs, teacher, mask)
    torch.testing.assert_close(metrics["loss/distill_term"], expected.detach(), rtol=1e-12, atol=1e-12)
    reference = kl_loss(reference_term, logprobs, logprobs.detach() + 0.1, mask)
    torch.testing.assert_close(total, expected + reference, rtol=1e-12, atol=1e-12)
    assert counter.as_dict().get("distill/clamped_k3") == b * t
    assert counter.as_dict().get("kl/clamped_k3", 0) == 0  # the reference term clamped nothing
