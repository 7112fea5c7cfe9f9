"""On-policy distillation through the trainer's passes: a student (2 layers, hidden 64) and a bigger teacher (4 layers,
hidden 96) with the student's vocabulary.

- pi_old's exact KL(student || teacher) per position and the teacher's log-probs equal float64 recomputations from the
  same final hidden states and output weights, on the unfused and fused paths, TP=1 and TP=2;
- the output-weight gradient of each distillation objective equals float64 autograd of the objective written out
  independently here (the weight enters only through the logits h W^T);
- TP=2 and PP=2 give TP=1's gradients (every parameter), forward and backward;
- a teacher equal to the student gives KL 0 to rounding and no gradient.
"""

import dataclasses

import pytest
import torch

from megatron_kl.config import ModelConfig, ParallelConfig
from megatron_kl.distill.config import DistillObjective
from megatron_kl.kl.objective import KLConfig
from megatron_kl.testing.distributed import run_ranks
from megatron_kl.validation.distill_workers import descent_worker, distill_step_worker, states_worker

VOCAB = 50
STUDENT = ModelConfig(
    architecture="qwen2",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    vocab_size=VOCAB,
    make_vocab_size_divisible_by=16,
)
TEACHER = ModelConfig(
    architecture="qwen2",
    num_layers=4,
    hidden_size=96,
    ffn_hidden_size=192,
    vocab_size=VOCAB,
    make_vocab_size_divisible_by=16,
)
EXACT_SEQUENCE = KLConfig(estimator="full", placement="loss", level="sequence", coef=0.5)
OBJECTIVES = {
    "full-loss-sequence": EXACT_SEQUENCE,
    "full-loss-token": dataclasses.replace(EXACT_SEQUENCE, level="token"),
    "k3-loss-token": KLConfig(estimator="k3", placement="loss", level="token", coef=0.5),
    "k1-reward-token-rtg": KLConfig(estimator="k1", placement="reward", level="token", coef=0.5),
}


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (4, 10), generator=g)
    mask = torch.zeros(4, 9)
    mask[:, 3:] = 1
    mask[1, 6:] = 0  # a shorter response
    mask[2, :] = 0  # an all-masked row
    return tokens, mask


@pytest.fixture(scope="module")
def states():
    return run_ranks(states_worker, 1, STUDENT, TEACHER)[0]


def _run(states, parallel, objective, fused, teacher_cfg=TEACHER, teacher_state=None):
    tokens, mask = _batch()
    world = parallel.tensor_parallel * parallel.pipeline_parallel
    outs = run_ranks(
        distill_step_worker,
        world,
        STUDENT,
        teacher_cfg,
        parallel,
        states["student"],
        states["teacher"] if teacher_state is None else teacher_state,
        tokens,
        mask,
        objective,
        fused,
    )
    last = [o for o in outs if o["last_stage"]][0]
    return last, outs[0]["grads"], tokens, mask


def _log_softmax64(hidden, weight):
    return torch.log_softmax(hidden.double() @ weight.double().t(), -1)


def _objective64(name, logp, logq, targets, mask, coef):
    """The distillation loss written out from the definitions (docs/distillation.md), aggregation
    seq_mean_token_sum (the sum over a sequence's tokens, mean over sequences)."""
    m = mask.double()
    batch = mask.shape[0]
    chosen = logp.gather(-1, targets[..., None])[..., 0]
    chosen_teacher = logq.gather(-1, targets[..., None])[..., 0]
    kl_t = (logp.exp() * (logp - logq)).sum(-1) * m
    d = (chosen - chosen_teacher) * m
    if name == "full-loss-token":
        return coef * kl_t.sum() / batch
    if name == "full-loss-sequence":  # pathwise KL_t plus the score term for the later positions' KL
        future = kl_t.detach().flip(-1).cumsum(-1).flip(-1) - kl_t.detach()
        return coef * (kl_t + chosen * m * future).sum() / batch
    if name == "k3-loss-token":
        return coef * ((torch.exp(-d) - 1 + d) * m).sum() / batch
    if name == "k1-reward-token-rtg":  # REINFORCE with the reward-to-go of -coef * d_s
        credit = (d.detach().flip(-1).cumsum(-1).flip(-1)) * m
        return coef * (chosen * credit * m).sum() / batch
    raise KeyError(name)


@pytest.mark.parametrize("tp", [1, 2])
def test_exact_kl_to_a_bigger_teacher_matches_float64(states, tp):
    tokens, mask = _batch()
    for fused in (False, True):
        out, _, tokens, mask = _run(states, ParallelConfig(tensor_parallel=tp), EXACT_SEQUENCE, fused)
        logp = _log_softmax64(out["hidden"][:, :-1], out["weight"])
        logq = _log_softmax64(out["teacher_hidden"][:, :-1], out["teacher_weight"])
        expected = (logp.exp() * (logp - logq)).sum(-1)
        on = mask.bool()
        rel = ((out["kl"][on].double() - expected[on]).abs() / expected[on]).max().item()
        assert expected[on].min() > 1e-3  # the teacher is far from the student here
        assert rel < 1e-4, (tp, fused, rel)
        assert (out["kl"][~on] == 0).all()
        teacher_chosen = logq.gather(-1, tokens[:, 1:, None])[..., 0]
        err = (out["teacher_logprobs"][on].double() - teacher_chosen[on]).abs().max().item()
        assert err < 1e-4, (tp, fused, err)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_output_weight_gradient_of_each_objective_matches_float64(states, name):
    objective = OBJECTIVES[name]
    out, grads, tokens, mask = _run(states, ParallelConfig(), objective, fused=True)
    weight = out["weight"].double().requires_grad_(True)
    logp = torch.log_softmax(out["hidden"][:, :-1].double() @ weight.t(), -1)
    logq = _log_softmax64(out["teacher_hidden"][:, :-1], out["teacher_weight"])
    _objective64(name, logp, logq, tokens[:, 1:], mask, objective.coef).backward()
    expected = weight.grad
    actual = grads["output_layer.weight"].double()
    err = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert expected.abs().max() > 1e-4
    assert err < 1e-4, (name, err)


def test_tensor_and_pipeline_parallel_give_the_single_rank_gradients(states):
    _, single, _, _ = _run(states, ParallelConfig(), EXACT_SEQUENCE, fused=True)
    for layout in (ParallelConfig(tensor_parallel=2), ParallelConfig(pipeline_parallel=2)):
        for fused in (False, True):
            _, grads, _, _ = _run(states, layout, EXACT_SEQUENCE, fused)
            assert grads.keys() == single.keys()
            for key, expected in single.items():
                scale = expected.abs().max().clamp_min(1e-6)
                err = ((grads[key] - expected).abs().max() / scale).item()
                assert err < 1e-4, (layout, fused, key, err)


def test_a_teacher_equal_to_the_student_gives_zero_kl_and_no_gradient(states):
    out, grads, _, mask = _run(
        states,
        ParallelConfig(tensor_parallel=2),
        EXACT_SEQUENCE,
        fused=True,
        teacher_cfg=STUDENT,
        teacher_state=states["student"],
    )
    on = mask.bool()
    assert out["kl"][on].abs().max().item() < 1e-7
    assert (out["logprobs"][on] - out["teacher_logprobs"][on]).abs().max().item() < 1e-5
    largest = max(g.abs().max().item() for g in grads.values())
    assert largest < 1e-5, largest


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_steps_on_a_fixed_batch_lower_the_exact_kl_to_the_teacher(states, level):
    """Gradient steps of the exact term on one batch of sequences: the exact KL to the teacher over those sequences
    falls at every step (token level: the objective itself; sequence level: its pathwise part dominates here)."""
    tokens, mask = _batch()
    objective = dataclasses.replace(EXACT_SEQUENCE, level=level, aggregation="token_mean", coef=1.0)
    kls = run_ranks(
        descent_worker,
        2,
        STUDENT,
        TEACHER,
        ParallelConfig(tensor_parallel=2),
        states["student"],
        states["teacher"],
        tokens,
        mask,
        objective,
        8,
    )[0]
    assert all(later < earlier for earlier, later in zip(kls, kls[1:])), kls
    assert kls[-1] < 0.5 * kls[0], kls


@pytest.mark.parametrize(
    "student_tp, teacher_tp, teacher_pp, world", [(1, 2, 1, 2), (2, 1, 1, 2), (1, 1, 2, 2), (2, 1, 2, 2), (1, 2, 2, 4)]
)
def test_a_teacher_in_its_own_layout_gives_the_single_rank_result(states, student_tp, teacher_tp, teacher_pp, world):
    """A student at TP 1 (data-parallel ranks) beside a teacher at TP 2, a student at TP 2 beside TP-1 teacher replicas,
    a teacher pipeline of two stages beside a student at TP 1 and at TP 2, and a TP-2 x PP-2 teacher beside four
    data-parallel student ranks: the teacher's log-probs, pi_old's exact KL to it and (one data-parallel rank) the
    distillation gradient equal one rank's with both models whole."""
    from megatron_kl.validation.distill_workers import own_layout_worker

    tokens, mask = _batch()
    objective = dataclasses.replace(EXACT_SEQUENCE, aggregation="token_mean")
    single = run_ranks(
        own_layout_worker,
        1,
        STUDENT,
        TEACHER,
        ParallelConfig(),
        1,
        states["student"],
        states["teacher"],
        tokens,
        mask,
        objective,
    )[0]
    outs = run_ranks(
        own_layout_worker,
        world,
        STUDENT,
        TEACHER,
        ParallelConfig(tensor_parallel=student_tp),
        teacher_tp,
        states["student"],
        states["teacher"],
        tokens,
        mask,
        objective,
        teacher_pp,
    )
    on = mask.bool()
    assert all(out["teacher_layers"] == TEACHER.num_layers // teacher_pp for out in outs)  # its own pipeline stages
    for out in outs:
        rows = out["rows"]
        for key in ("kl", "teacher_logprobs"):
            expected, actual = single[key][rows], out[key]
            assert (actual[~on[rows]] == 0).all()
            err = ((actual - expected).abs().max() / single[key].abs().max()).item()
            assert err < 1e-5, (key, err)
    if student_tp == world:  # one data-parallel rank: the whole batch's gradient
        for key, expected in single["grads"].items():
            err = ((outs[0]["grads"][key] - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()
            assert err < 1e-4, (key, err)


TOP_K_OBJECTIVES = {
    "topk7_bucket-loss-sequence": DistillObjective(
        estimator="topk", top_k=7, top_k_tail="bucket", coef=0.5, aggregation="seq_mean_token_sum"
    ),
    "topk7_renormalize-loss-token": DistillObjective(
        estimator="topk", top_k=7, top_k_tail="renormalize", level="token", coef=0.5, aggregation="seq_mean_token_sum"
    ),
    "topk3_bucket-reward-token-rtg": DistillObjective(
        estimator="topk", top_k=3, placement="reward", level="token", coef=0.5, aggregation="seq_mean_token_sum"
    ),
}


def _top_k64(logp, logq, ids, tail):
    """The top-k divergence written out from its definition (megatron_kl.kl.topk), float64, naive."""
    a, b = logp.gather(-1, ids), logq.gather(-1, ids)
    if tail == "renormalize":
        qa, qb = a.log_softmax(-1), b.log_softmax(-1)
        return (qa.exp() * (qa - qb)).sum(-1)
    rest_a, rest_b = 1 - a.exp().sum(-1), 1 - b.exp().sum(-1)
    return (a.exp() * (a - b)).sum(-1) + rest_a * torch.log(rest_a / rest_b)


def _top_k_objective64(objective, logp, logq, ids, targets, mask):
    m = mask.double()
    d_t = _top_k64(logp, logq, ids, objective.top_k_tail) * m
    chosen = logp.gather(-1, targets[..., None])[..., 0] * m
    batch, coef = mask.shape[0], objective.coef
    if objective.placement == "reward":  # REINFORCE with the reward-to-go of the fixed per-position values
        credit = d_t.detach().flip(-1).cumsum(-1).flip(-1)
        return coef * (chosen * credit).sum() / batch
    if objective.level == "token":
        return coef * d_t.sum() / batch
    future = d_t.detach().flip(-1).cumsum(-1).flip(-1) - d_t.detach()
    return coef * (d_t + chosen * future).sum() / batch


@pytest.mark.parametrize("tp", [1, 2])
def test_teacher_top_k_and_the_students_log_probs_at_it_match_float64(states, tp):
    objective = TOP_K_OBJECTIVES["topk7_bucket-loss-sequence"]
    for fused in (False, True):
        out, _, tokens, mask = _run(states, ParallelConfig(tensor_parallel=tp), objective, fused)
        logp = _log_softmax64(out["hidden"][:, :-1], out["weight"])
        logq = _log_softmax64(out["teacher_hidden"][:, :-1], out["teacher_weight"])
        expected_ids = logq.topk(objective.top_k, -1).indices
        assert torch.equal(out["teacher_top_ids"], expected_ids), (tp, fused)
        err = (out["teacher_top_logprobs"].double() - logq.gather(-1, expected_ids)).abs().max().item()
        assert err < 1e-5, (tp, fused, err)
        on = mask.bool()
        student_at_ids = logp.gather(-1, expected_ids)
        err = (out["candidate_logprobs"][on].double() - student_at_ids[on]).abs().max().item()
        assert err < 1e-5, (tp, fused, err)
        assert (out["candidate_logprobs"][~on] == 0).all()


@pytest.mark.parametrize("name", list(TOP_K_OBJECTIVES))
def test_output_weight_gradient_of_each_top_k_objective_matches_float64(states, name):
    objective = TOP_K_OBJECTIVES[name]
    out, grads, tokens, mask = _run(states, ParallelConfig(), objective, fused=True)
    weight = out["weight"].double().requires_grad_(True)
    logp = torch.log_softmax(out["hidden"][:, :-1].double() @ weight.t(), -1)
    logq = _log_softmax64(out["teacher_hidden"][:, :-1], out["teacher_weight"])
    ids = logq.topk(objective.top_k, -1).indices
    _top_k_objective64(objective, logp, logq, ids, tokens[:, 1:], mask).backward()
    expected, actual = weight.grad, grads["output_layer.weight"].double()
    err = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert expected.abs().max() > 1e-4
    assert err < 1e-4, (name, err)


def test_top_k_term_under_tensor_and_pipeline_parallel_gives_the_single_rank_gradients(states):
    objective = TOP_K_OBJECTIVES["topk7_bucket-loss-sequence"]
    _, single, _, _ = _run(states, ParallelConfig(), objective, fused=True)
    for layout, fused in (
        (ParallelConfig(tensor_parallel=2), True),
        (ParallelConfig(tensor_parallel=2), False),
        (ParallelConfig(pipeline_parallel=2), True),
    ):
        _, grads, _, _ = _run(states, layout, objective, fused)
        for key, expected in single.items():
            err = ((grads[key] - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()
            assert err < 1e-4, (layout, fused, key, err)


def test_a_top_k_teacher_equal_to_the_student_gives_zero_divergence_and_no_gradient(states):
    objective = TOP_K_OBJECTIVES["topk7_bucket-loss-sequence"]
    out, grads, _, mask = _run(
        states,
        ParallelConfig(tensor_parallel=2),
        objective,
        fused=True,
        teacher_cfg=STUDENT,
        teacher_state=states["student"],
    )
    on = mask.bool()
    assert (out["candidate_logprobs"][on] - out["teacher_top_logprobs"][on]).abs().max().item() < 1e-5
    largest = max(g.abs().max().item() for g in grads.values())
    assert largest < 1e-5, largest


@pytest.mark.parametrize("teacher_tp, teacher_pp", [(2, 1), (1, 2)])
def test_a_mixture_of_experts_teacher_in_its_own_layout_gives_the_single_rank_result(teacher_tp, teacher_pp):
    """A mixture-of-experts teacher (4 experts, top-2) at TP 2 and as a two-stage pipeline in layouts of its own
    beside a student at TP 1 (two data-parallel ranks): its log-probs and pi_old's exact KL to it equal one rank's."""
    from megatron_kl.config import MoEConfig
    from megatron_kl.validation.distill_workers import own_layout_worker

    teacher = dataclasses.replace(TEACHER, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=96))
    moe_states = run_ranks(states_worker, 1, STUDENT, teacher)[0]
    tokens, mask = _batch()
    objective = dataclasses.replace(EXACT_SEQUENCE, aggregation="token_mean")
    single = run_ranks(
        own_layout_worker,
        1,
        STUDENT,
        teacher,
        ParallelConfig(),
        1,
        moe_states["student"],
        moe_states["teacher"],
        tokens,
        mask,
        objective,
    )[0]
    outs = run_ranks(
        own_layout_worker,
        2,
        STUDENT,
        teacher,
        ParallelConfig(),
        teacher_tp,
        moe_states["student"],
        moe_states["teacher"],
        tokens,
        mask,
        objective,
        teacher_pp,
    )
    on = mask.bool()
    for out in outs:
        rows = out["rows"]
        for key in ("kl", "teacher_logprobs"):
            assert (out[key][~on[rows]] == 0).all()
            err = ((out[key] - single[key][rows]).abs().max() / single[key].abs().max()).item()
            assert err < 1e-5, (key, err)


def test_a_mixture_of_experts_teacher_routes_itself_whatever_routing_the_batch_carries():
    """The rollout's routing is the student's (its layers, its experts): a batch carrying one (here of another depth and
    expert count than the teacher's) is scored by the teacher with its own routing, as if it carried none."""
    from megatron_kl.config import MoEConfig
    from megatron_kl.validation.distill_workers import teacher_routing_worker

    teacher = dataclasses.replace(TEACHER, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=96))
    moe_states = run_ranks(states_worker, 1, STUDENT, teacher)[0]
    tokens, mask = _batch()
    student_routing = torch.randint(0, 8, (tokens.shape[0], tokens.shape[1], 2, 2), dtype=torch.int16)
    out = run_ranks(teacher_routing_worker, 1, STUDENT, teacher, moe_states["teacher"], tokens, mask, student_routing)[
        0
    ]
    assert out["without"].abs().max() > 0 and torch.equal(out["with"], out["without"])


REFERENCE_TERM = KLConfig(estimator="full", placement="loss", level="token", coef=0.3)


@pytest.fixture(scope="module")
def reference_state():
    return run_ranks(states_worker, 1, STUDENT, TEACHER, 7)[0]["student"]  # a reference apart from the student


def _run_with_reference(states, reference_state, parallel, fused):
    tokens, mask = _batch()
    world = parallel.tensor_parallel * parallel.pipeline_parallel
    outs = run_ranks(
        distill_step_worker,
        world,
        STUDENT,
        TEACHER,
        parallel,
        states["student"],
        states["teacher"],
        tokens,
        mask,
        EXACT_SEQUENCE,
        fused,
        1.0,
        reference_state,
        REFERENCE_TERM,
    )
    return [o for o in outs if o["last_stage"]][0], outs[0]["grads"], tokens, mask


@pytest.mark.parametrize("fused", [False, True])
def test_the_exact_kl_to_the_reference_beside_the_teachers_matches_float64(states, reference_state, fused):
    """Both exact KLs in one run: pi_old's KL to the teacher and to the reference against float64 recomputations,
    and the output-weight gradient of the distillation term plus the exact reference term in the loss against
    float64 autograd of both written out."""
    out, grads, tokens, mask = _run_with_reference(states, reference_state, ParallelConfig(), fused)
    weight = out["weight"].double().requires_grad_(True)
    logp = torch.log_softmax(out["hidden"][:, :-1].double() @ weight.t(), -1)
    logq = _log_softmax64(out["teacher_hidden"][:, :-1], out["teacher_weight"])
    logr = _log_softmax64(out["reference_hidden"][:, :-1], out["reference_weight"])
    on = mask.bool()
    to_reference = (logp.exp() * (logp - logr)).sum(-1).detach()
    to_teacher = (logp.exp() * (logp - logq)).sum(-1).detach()
    for key, expected in (("regularizer_kl", to_reference), ("kl", to_teacher)):
        assert expected[on].min() > 1e-3
        rel = ((out[key][on].double() - expected[on]).abs() / expected[on]).max().item()
        assert rel < 1e-4, (key, fused, rel)
        assert (out[key][~on] == 0).all()
    reference_term = REFERENCE_TERM.coef * ((logp.exp() * (logp - logr)).sum(-1) * mask.double()).sum() / mask.shape[0]
    total = _objective64("full-loss-sequence", logp, logq, tokens[:, 1:], mask, EXACT_SEQUENCE.coef) + reference_term
    total.backward()
    expected, actual = weight.grad, grads["output_layer.weight"].double()
    err = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-4, (fused, err)


def test_both_exact_kls_under_tensor_and_pipeline_parallel_give_the_single_rank_gradients(states, reference_state):
    _, single, _, _ = _run_with_reference(states, reference_state, ParallelConfig(), True)
    for layout, fused in (
        (ParallelConfig(tensor_parallel=2), True),
        (ParallelConfig(tensor_parallel=2), False),
        (ParallelConfig(pipeline_parallel=2), True),
    ):
        _, grads, _, _ = _run_with_reference(states, reference_state, layout, fused)
        for key, expected in single.items():
            err = ((grads[key] - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()
            assert err < 1e-4, (layout, fused, key, err)
