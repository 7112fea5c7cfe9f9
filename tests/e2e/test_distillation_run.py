"""Distillation through the whole trainer: a teacher equal to the student (the same warm start) gives KL 0 at step 0;
with a bigger teacher and distillation alone every distill/* key is registered, the teacher's pass is timed and the
policy loss is zero. (That the term's gradient descends the KL to the teacher: tests/distributed/test_distillation.)"""

from megatron_kl.testing.distributed import run_ranks
from megatron_kl.train.metric_registry import lookup
from tests.e2e.runs import short_config
from tests.e2e.workers import train_worker

STUDENT = ("model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256")


def _distill(*overrides):
    return (
        "distill.enabled=true",
        "kl.estimator=k3",
        "kl.coef=0.01",
        "warm_start.steps=30",
        "warm_start.seed=5",
        "distill.teacher.model.vocab_size=32",
        "distill.teacher.model.max_position_embeddings=32",
        *overrides,
    )


def test_a_teacher_equal_to_the_student_starts_at_zero_kl(tmp_path):
    """With the exact KL to the reference beside the teacher's (kl.estimator=full): both are 0 at step 0 (the reference
    is the start, and so is the teacher here), and once the policy has moved they stay equal (teacher = reference)."""
    same = [f"distill.teacher.model.{o.split('.', 1)[1]}" for o in STUDENT]
    cfg = short_config(
        tmp_path / "run",
        str(tmp_path / "cache"),
        "train.steps=3",
        *_distill(
            *same,
            "distill.teacher.warm_start_steps=30",
            "distill.teacher.warm_start_seed=5",
            "kl.estimator=full",
            "kl.placement=loss",
            "kl.level=token",
        ),
    )
    records = run_ranks(train_worker, 1, cfg, timeout_s=600)[0]["metrics"]
    steps = [r for r in records if "distill/exact_token" in r]
    first = steps[0]
    assert abs(first["distill/exact_token"]) < 1e-7 and abs(first["distill/k1_token"]) < 1e-5
    assert abs(first["kl/exact_token"]) < 1e-7
    assert first["time/teacher"] > 0 and first["distill/biased"] == 0.0
    moved = steps[-1]
    assert 1e-4 < moved["kl/exact_token"] < 1e-1  # off the reference, seen by the exact KL to it
    assert abs(moved["kl/exact_token"] - moved["distill/exact_token"]) < 1e-6 * moved["kl/exact_token"] + 1e-9


def test_distillation_alone_with_a_bigger_teacher(tmp_path):
    cfg = short_config(
        tmp_path / "run",
        str(tmp_path / "cache"),
        "train.steps=3",
        "distill.task_reward=none",
        *_distill(
            "distill.teacher.model.num_layers=3",
            "distill.teacher.model.hidden_size=192",
            "distill.teacher.model.ffn_hidden_size=384",
            "distill.teacher.warm_start_steps=60",
        ),
    )
    one = run_ranks(train_worker, 1, cfg, timeout_s=600)[0]
    records = [r for r in one["metrics"] if "distill/exact_token" in r]
    assert len(records) == 3
    assert all(0.01 < r["distill/exact_token"] < 10 and r["time/teacher"] > 0 for r in records), records
    for record in records:
        unregistered = [k for k in record if lookup(k) is None]
        assert not unregistered, unregistered
        assert record["loss/policy"] == 0.0  # distillation alone: no task advantage
    assert one["summary"].run_name.startswith("distill-full-loss-sequence-coef1-")


def test_a_teacher_in_a_layout_of_its_own_trains_as_in_the_students_layout(tmp_path):
    """Two ranks, the student at TP 1 (data parallel 2): the teacher at TP 2, and the teacher as a pipeline of two
    stages, in layouts of its own log what the teacher in the student's layout logs, step for step, to fp32 rounding."""
    from tests.e2e.runs import assert_same_metrics

    runs = {}
    for name, extra in (
        ("student-layout", ()),
        ("own-tp2", ("distill.teacher.tensor_parallel=2", "distill.teacher.pipeline_parallel=1")),
        ("own-pp2", ("distill.teacher.tensor_parallel=1", "distill.teacher.pipeline_parallel=2")),
    ):
        cfg = short_config(
            tmp_path / name,
            str(tmp_path / "cache"),
            "train.steps=2",
            "distill.kl.level=token",
            *_distill(
                "distill.teacher.model.num_layers=4",
                "distill.teacher.model.hidden_size=192",
                "distill.teacher.model.ffn_hidden_size=384",
                "distill.teacher.warm_start_steps=20",
                *extra,
            ),
        )
        runs[name] = run_ranks(train_worker, 2, cfg, timeout_s=600)[0]["metrics"]
    assert_same_metrics(runs["student-layout"], runs["own-tp2"], "teacher at TP 2 vs the student's layout")
    assert_same_metrics(runs["student-layout"], runs["own-pp2"], "teacher at PP 2 vs the student's layout")
    assert any("distill/exact_token" in r for r in runs["own-pp2"])
