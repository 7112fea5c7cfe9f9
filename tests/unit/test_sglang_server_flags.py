"""One builder of the SGLang servers' flags (``rollout/sglang.server_flags``): the managed servers and the servers a
Slurm job starts get the same flags for the same training config - routing replay's routed experts, FP8, the delta
loader - and differ only in what each owns (address, layout, memory saver, how the key is given)."""

from pathlib import Path

import pytest

from megatron_kl.constraints import paths_unchecked
from megatron_kl.launch.jobs import rollout_server_args
from megatron_kl.rollout.config import DELTA_LOADER
from megatron_kl.rollout.sglang import server_command
from megatron_kl.train.config import load_train_config

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "configs/paper/qwen3-30b-a3b.yaml"  # routing_replay: rollout
OWNED = {"--model-path", "--host", "--port", "--tp-size", "--dp-size", "--mem-fraction-static", "--api-key"}


def _implied(flags: list[str]) -> list[str]:
    """The flags the training config implies (each owned flag and its value dropped)."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag in OWNED:
            skip = True
            continue
        out.append(flag)
    return out


@pytest.mark.parametrize(
    "overrides",
    [[], ["rollout.quantization=fp8"], ["rollout.delta_sync=true", "rollout.sglang.weight_sync=from_tensor"]],
)
def test_managed_and_slurm_servers_get_the_flags_the_config_implies(overrides):
    with paths_unchecked():
        cfg = load_train_config(
            MOE,
            [
                "rollout.sglang.colocated=false",
                "rollout.sglang.enable_memory_saver=false",
                "launch.rollout_servers.mode=disaggregated",
                *overrides,
            ],
        )
    delta = [DELTA_LOADER] if cfg.rollout.delta_sync else []
    managed = server_command(
        cfg.rollout.sglang,
        "/models/m",
        30000,
        cfg.train.seed,
        api_key="k",
        routed_experts=cfg.model.moe.routing_replay == "rollout",
        quantization=cfg.rollout.quantization,
        weight_loaders=delta,
    )[3:]
    launched = rollout_server_args(cfg)
    assert _implied(managed) == _implied(launched)
    assert "--enable-return-routed-experts" in launched  # routing replay with disaggregated servers
    assert ("--quantization" in launched) == (cfg.rollout.quantization == "fp8")
    assert ("--custom-weight-loader" in launched) == bool(delta)


def test_without_routing_replay_no_server_reports_routes():
    with paths_unchecked():
        cfg = load_train_config(
            MOE,
            [
                "model.moe.routing_replay=off",
                "rollout.sglang.colocated=false",
                "rollout.sglang.enable_memory_saver=false",
                "launch.rollout_servers.mode=disaggregated",
            ],
        )
    assert "--enable-return-routed-experts" not in rollout_server_args(cfg)
