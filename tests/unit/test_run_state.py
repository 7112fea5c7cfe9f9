"""The registry of a run's stateful parts (run/run_state.py): what a checkpoint saves is what a resume loads,
the two step counters stay apart, and a state that lacks a registered part is refused naming it."""

import pytest

from megatron_kl.run.run_state import Counters, RunState


class Schedule:
    def __init__(self):
        self.num_steps = 0

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state):
        self.num_steps = state["num_steps"]


def _run_state():
    counters, schedule, queue = Counters(), Schedule(), Schedule()
    return RunState(None, shared={"scheduler": schedule, "counters": counters}, per_rank={"rollouts": queue})


def test_saved_parts_load_back_into_a_fresh_run_state():
    saved = _run_state()
    saved.counters.rl_steps, saved.counters.optimizer_steps, saved.counters.skipped_updates = 5, 19, 1
    saved.shared["scheduler"].num_steps, saved.per_rank["rollouts"].num_steps = 19, 7
    loaded = _run_state()
    loaded.load_shared(saved.shared_state(), "trainer.pt")
    loaded.load_rank(saved.rank_state(), "rank_00000.pt")
    assert loaded.counters == Counters(5, 19, 1) and loaded.shared["scheduler"].num_steps == 19
    assert loaded.per_rank["rollouts"].num_steps == 7


def test_a_checkpoint_from_before_the_two_counters_reads_its_rl_step_and_schedule():
    loaded = _run_state()
    loaded.load_shared({"step": 6, "scheduler": {"num_steps": 12}, "run_name": "x"}, "trainer.pt")
    assert loaded.counters == Counters(rl_steps=6, optimizer_steps=12, skipped_updates=0)


def test_a_state_without_a_registered_part_is_refused_naming_it():
    loaded = _run_state()
    with pytest.raises(ValueError, match="rank_00001.pt has no rollouts"):
        loaded.load_rank({"rng": {}}, "rank_00001.pt")
    with pytest.raises(ValueError, match="trainer.pt has no counters"):
        loaded.load_shared({"scheduler": {"num_steps": 1}}, "trainer.pt")
