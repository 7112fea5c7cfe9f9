"""Rank functions for the distillation tests: a student and a bigger teacher in one layout, the teacher's pass, the
student's pi_old pass with the exact KL to the teacher, and one update of a distillation loss (module level so
spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kl.algo.config import AlgoConfig
from megatron_kl.algo.losses import LossInputs, MicrobatchLoss, Shares
from megatron_kl.config import ModelConfig, ParallelConfig
from megatron_kl.distill.layout import ResharedHead, build_in_own_layout, expert_groups, reshard_output_weight
from megatron_kl.distill.teacher import Teacher
from megatron_kl.kl.config import TOP_K
from megatron_kl.kl.objective import KLConfig, kl_shaped_returns
from megatron_kl.kl.topk import top_k_divergence
from megatron_kl.models import builder, optim, output_head, parallel, pipeline, state
from megatron_kl.models.offload import ReferenceOffload
from megatron_kl.train.topology import Topology


def _full_output_weight(chunks, model_cfg) -> torch.Tensor:
    """The last stage's output weight [V, H], gathered over TP and trimmed to the vocabulary."""
    weight = output_head.output_weight(output_head.unwrap(chunks[-1])).detach()
    group = parallel.tp_group()
    pieces = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, weight.contiguous(), group=group)
    return torch.cat(pieces)[: model_cfg.vocab_size]


def _student_and_teacher(
    student_cfg: ModelConfig, teacher_cfg: ModelConfig, parallel_cfg: ParallelConfig, student_state, teacher_state
):
    """Process groups for ``parallel_cfg``, then the student (trainable) and the frozen teacher in that layout with
    their full states loaded, and the teacher's head."""
    parallel.initialize(student_cfg, parallel_cfg, seed=1234)
    tp_group = parallel.tp_group()
    tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    student = builder.build_model_chunks(student_cfg, parallel_cfg)
    teacher = builder.freeze(builder.build_model_chunks(teacher_cfg, parallel_cfg))
    state.load_full_state_dict(student, student_state, False, tp_rank, tp_size)
    state.load_full_state_dict(teacher, teacher_state, False, tp_rank, tp_size)
    return student, teacher, output_head.ReferenceHead(teacher)


def distill_step_worker(
    rank,
    world,
    student_cfg: ModelConfig,
    teacher_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    student_state,
    teacher_state,
    tokens,
    loss_mask,
    objective: KLConfig,
    fused: bool,
    temperature: float = 1.0,
    reference_state=None,
    reference_term: KLConfig = KLConfig(coef=0.0),
):
    """The student's pi_old stats with the exact KL to the teacher (as ``rl_step`` computes them under distillation),
    then one optimizer step of the distillation term (no task advantage; with ``reference_state``, a reference of the
    student's architecture whose exact KL is taken beside the teacher's, and ``reference_term`` on it). Returns, in
    the full layout: pi_old's log-probs and exact KL (and exact KL to the reference), the teacher's log-probs, the
    models' final hidden states and output weights (for a float64 recomputation), and the gradient."""
    torch.manual_seed(0)
    student, teacher, head = _student_and_teacher(student_cfg, teacher_cfg, parallel_cfg, student_state, teacher_state)
    tp_group, pp_group = parallel.tp_group(), parallel.pp_group()
    vocab = pipeline.VocabOptions(vocab_size=student_cfg.vocab_size, temperature=temperature, chunk_size=5, fused=fused)
    batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=loss_mask)
    teacher_stats = pipeline.compute_token_stats(teacher, batch, 2, vocab, capture_hidden=True)
    batch.reference_hidden = teacher_stats.hidden
    reference_stats = reference_weight = None
    if reference_state is not None:  # the reference beside the teacher: output_head.WithRegularizer
        reference = builder.freeze(builder.build_model_chunks(student_cfg, parallel_cfg))
        state.load_full_state_dict(
            reference, reference_state, False, dist.get_rank(tp_group), dist.get_world_size(tp_group)
        )
        reference_stats = pipeline.compute_token_stats(reference, batch, 2, vocab, capture_hidden=True)
        batch.regularizer_hidden = reference_stats.hidden
        head = output_head.WithRegularizer(head, output_head.ReferenceHead(reference))
        if reference_stats.hidden is not None:
            reference_weight = _full_output_weight(reference, student_cfg)
    top_logprobs = None
    if objective.estimator == TOP_K:  # the teacher as its top-k, formed as the trainer forms it
        frozen = Teacher(teacher, teacher_cfg, ReferenceOffload(teacher, False))
        ids, top_logprobs = frozen.top_k(teacher_stats.hidden, objective.top_k, vocab, tp_group)
        shape = (*loss_mask.shape, objective.top_k)
        batch.teacher_top_ids = pipeline.broadcast_from_last_stage(ids, shape, torch.long)
        top_logprobs = pipeline.broadcast_from_last_stage(top_logprobs, shape, torch.float32)
    old = pipeline.compute_token_stats(student, batch, 2, vocab, reference=head, capture_hidden=True)

    last_stage = old.hidden is not None
    weights = (
        (_full_output_weight(student, student_cfg), _full_output_weight(teacher, teacher_cfg))
        if last_stage
        else (None, None)
    )  # before the update changes the student's
    mask = loss_mask
    zeros = torch.zeros(mask.shape)
    rewards = torch.zeros(tokens.shape[0])
    per_position = old.kl
    if top_logprobs is not None:
        per_position = top_k_divergence(old.candidate_logprobs, top_logprobs, objective.top_k_tail) * mask
    reference_logprobs = reference_stats.logprobs if reference_stats is not None else zeros
    inputs = LossInputs(
        loss_mask=mask,
        behavior_logprobs=old.logprobs,
        reference_logprobs=reference_logprobs,
        advantages=zeros,
        old_logprobs=old.logprobs,
        kl_returns=kl_shaped_returns(
            reference_term, rewards, old.logprobs, reference_logprobs, mask, old.logprobs, full_kl=old.regularizer_kl
        ),
        teacher_logprobs=teacher_stats.logprobs,
        distill_returns=kl_shaped_returns(
            objective.per_position() if top_logprobs is not None else objective,
            rewards,
            old.logprobs,
            teacher_stats.logprobs,
            mask,
            old.logprobs,
            full_kl=per_position,
        ),
        teacher_top_logprobs=top_logprobs,
    )
    train = optim.build_train_state(student, optim.OptimConfig(lr=1e-3, clip_grad=0.0))
    shares = Shares(num_sequences=tokens.shape[0], num_tokens=float(mask.sum()))
    loss = MicrobatchLoss(AlgoConfig(), reference_term, shares, distill=objective)
    needs_head = objective.exact and objective.placement == "loss" or reference_state is not None
    optim.train_step(train, inputs.into(batch), 2, loss, vocab, reference=head if needs_head else None)
    inner = [c.module for c in train.chunks]
    grads = state.full_state_dict(inner, student_cfg.vocab_size, False, tp_group, pp_group, getter=optim.main_grad)
    return {
        "last_stage": last_stage,
        "logprobs": old.logprobs,
        "kl": old.kl,
        "teacher_logprobs": teacher_stats.logprobs,
        "hidden": old.hidden,
        "teacher_hidden": teacher_stats.hidden,
        "weight": weights[0],
        "teacher_weight": weights[1],
        "grads": grads,
        "teacher_top_ids": batch.teacher_top_ids,
        "teacher_top_logprobs": top_logprobs,
        "candidate_logprobs": old.candidate_logprobs,
        "regularizer_kl": old.regularizer_kl,
        "reference_hidden": None if reference_stats is None else reference_stats.hidden,
        "reference_weight": reference_weight,
    }


def student_and_teacher_states(student_cfg: ModelConfig, teacher_cfg: ModelConfig, seed: int = 0):
    """Full states of a randomly initialised student and teacher (built on one rank by megatron itself)."""
    out = {}
    for name, cfg in (("student", student_cfg), ("teacher", teacher_cfg)):
        parallel.initialize(cfg, ParallelConfig(), seed=seed + (name == "teacher"))
        chunks = builder.build_model_chunks(cfg, ParallelConfig())
        out[name] = state.full_state_dict(chunks, cfg.vocab_size, False, parallel.tp_group(), parallel.pp_group())
    return out


def states_worker(rank, world, student_cfg: ModelConfig, teacher_cfg: ModelConfig, seed: int = 0):
    return student_and_teacher_states(student_cfg, teacher_cfg, seed)


def descent_worker(
    rank,
    world,
    student_cfg: ModelConfig,
    teacher_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    student_state,
    teacher_state,
    tokens,
    loss_mask,
    objective: KLConfig,
    steps: int,
) -> list[float]:
    """``steps`` optimizer steps of the distillation term on one fixed batch; the exact KL(student || teacher) per
    response token over the batch before each step (pi_old's pass with the teacher's head)."""
    student, teacher, head = _student_and_teacher(student_cfg, teacher_cfg, parallel_cfg, student_state, teacher_state)
    vocab = pipeline.VocabOptions(vocab_size=student_cfg.vocab_size, fused=True)
    train = optim.build_train_state(student, optim.OptimConfig(lr=1e-3, clip_grad=1.0))
    zeros = torch.zeros(loss_mask.shape)
    shares = Shares(num_sequences=tokens.shape[0], num_tokens=float(loss_mask.sum()))
    loss = MicrobatchLoss(AlgoConfig(), KLConfig(coef=0.0), shares, distill=objective)
    kls = []
    for _ in range(steps):
        batch = pipeline.SequenceBatch(tokens=tokens, loss_mask=loss_mask)
        teacher_stats = pipeline.compute_token_stats(teacher, batch, 1, vocab, capture_hidden=True)
        batch.reference_hidden = teacher_stats.hidden
        old = pipeline.compute_token_stats(train.chunks, batch, 1, vocab, reference=head)
        kls.append(float((old.kl * loss_mask).sum() / loss_mask.sum()))
        inputs = LossInputs(
            loss_mask=loss_mask,
            behavior_logprobs=old.logprobs,
            reference_logprobs=zeros,
            advantages=zeros,
            old_logprobs=old.logprobs,
            kl_returns=zeros,
            teacher_logprobs=teacher_stats.logprobs,
            distill_returns=zeros,
        )
        optim.train_step(train, inputs.into(batch), 1, loss, vocab, reference=head)
    return kls


def own_layout_worker(
    rank,
    world,
    student_cfg: ModelConfig,
    teacher_cfg: ModelConfig,
    student_parallel: ParallelConfig,
    teacher_tp: int,
    student_state,
    teacher_state,
    tokens,
    loss_mask,
    objective: KLConfig,
    teacher_pp: int = 1,
):
    """A teacher at ``teacher_tp`` x ``teacher_pp`` in its own layout beside a student at ``student_parallel`` (the
    rest of the world data parallel): this rank's rows (contiguous split over the student's data-parallel ranks), the
    teacher's log-probs, pi_old's exact KL to the teacher through the resharded head, and the gradient of one step of
    the distillation term (full layout)."""
    torch.manual_seed(0)
    parallel.initialize(student_cfg, student_parallel, seed=1234)
    topology = Topology.from_parallel_state()
    tp_group, pp_group = parallel.tp_group(), parallel.pp_group()
    student = builder.build_model_chunks(student_cfg, student_parallel)
    state.load_full_state_dict(student, student_state, False, dist.get_rank(tp_group), dist.get_world_size(tp_group))
    own, chunks = build_in_own_layout(
        teacher_cfg, ParallelConfig(tensor_parallel=teacher_tp, pipeline_parallel=teacher_pp), 120.0
    )
    state.load_full_state_dict(chunks, teacher_state, False, dist.get_rank(own.tp), teacher_tp, expert_groups(own))
    head = ResharedHead(
        reshard_output_weight(
            chunks[0],
            own,
            teacher_cfg.vocab_size,
            student_cfg.padded_vocab_size(student_parallel.tensor_parallel),
            tp_group,
        )
    )
    teacher = Teacher(
        chunks, teacher_cfg, ReferenceOffload(chunks, False), own, head, topology.dp_rank, topology.dp_size
    )
    rows = torch.arange(tokens.shape[0]).tensor_split(topology.dp_size)[topology.dp_rank]
    vocab = pipeline.VocabOptions(vocab_size=student_cfg.vocab_size, chunk_size=5, fused=True)
    batch = pipeline.SequenceBatch(tokens=tokens[rows], loss_mask=loss_mask[rows])
    teacher_stats = teacher.score(batch, 2, vocab, capture_hidden=True)
    batch.reference_hidden = teacher_stats.hidden
    old = pipeline.compute_token_stats(student, batch, 1, vocab, reference=teacher.head)
    mask = loss_mask[rows]
    zeros = torch.zeros(mask.shape)
    inputs = LossInputs(
        loss_mask=mask,
        behavior_logprobs=old.logprobs,
        reference_logprobs=zeros,
        advantages=zeros,
        old_logprobs=old.logprobs,
        kl_returns=zeros,
        teacher_logprobs=teacher_stats.logprobs,
        distill_returns=zeros,
    )
    train = optim.build_train_state(student, optim.OptimConfig(lr=1e-3, clip_grad=0.0))
    loss = MicrobatchLoss(AlgoConfig(), KLConfig(coef=0.0), Shares(rows.numel(), float(mask.sum())), distill=objective)
    optim.train_step(train, inputs.into(batch), 1, loss, vocab, reference=teacher.head)
    inner = [c.module for c in train.chunks]
    grads = state.full_state_dict(inner, student_cfg.vocab_size, False, tp_group, pp_group, getter=optim.main_grad)
    layers = len(output_head.unwrap(chunks[0]).decoder.layers)  # the teacher's layers this rank holds
    return {
        "rows": rows,
        "kl": old.kl,
        "teacher_logprobs": teacher_stats.logprobs,
        "grads": grads,
        "teacher_layers": layers,
    }


def teacher_routing_worker(
    rank, world, student_cfg: ModelConfig, teacher_cfg: ModelConfig, teacher_state, tokens, loss_mask, routed_experts
):
    """A mixture-of-experts teacher in the student's layout scoring a batch that carries the rollout's routing (the
    student's experts, ``routed_experts``) and the same batch without it: both log-prob tensors."""
    parallel.initialize(student_cfg, ParallelConfig(), seed=1234)
    chunks = builder.freeze(builder.build_model_chunks(teacher_cfg, ParallelConfig()))
    state.load_full_state_dict(chunks, teacher_state, False, 0, 1)
    teacher = Teacher(chunks, teacher_cfg, ReferenceOffload(chunks, False))
    vocab = pipeline.VocabOptions(vocab_size=student_cfg.vocab_size)
    carried = pipeline.SequenceBatch(tokens, loss_mask, routed_experts=routed_experts)
    return {
        "with": teacher.score(carried, 1, vocab, capture_hidden=False).logprobs,
        "without": teacher.score(pipeline.SequenceBatch(tokens, loss_mask), 1, vocab, capture_hidden=False).logprobs,
    }
