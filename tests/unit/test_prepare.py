"""A start's checks resolve the configuration into a new object: the loaded one and the random generators are left
as they were (``megatron-kl train --check`` touches nothing), and the resolved one carries what was filled in."""

import random

import numpy as np
import torch

from megatron_kl.config import to_dict
from megatron_kl.train.config import load_train_config
from megatron_kl.train.loop import prepare


def test_prepare_resolves_a_copy_and_leaves_the_config_and_the_generators_alone(tmp_path):
    cfg = load_train_config(
        "configs/cpu/default.yaml",
        [f"train.output_dir={tmp_path}/run", "kl.estimator=auto", "kl.target=sequence_reverse"],
    )
    loaded = to_dict(cfg)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    prepared = prepare(cfg)
    assert to_dict(cfg) == loaded and cfg.rollout.sampling.stop_token_ids == []
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert (np.random.get_state()[1] == states[2]).all()
    resolved = prepared.config
    assert resolved is not cfg and resolved.rollout.sampling.stop_token_ids == [prepared.task.tokenizer.eos_id]
    assert resolved.kl_selection is not None and resolved.kl_selection is cfg.kl_selection  # auto's choice kept
    assert {k: v for k, v in to_dict(resolved).items() if k != "rollout"} == {
        k: v for k, v in loaded.items() if k != "rollout"
    }
