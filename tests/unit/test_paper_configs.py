"""The paper's three model configs: each YAML loads, fits an 8 x H100 node's layout, and its model section
matches the model's real config.json (stored under tests/data/hf_configs, transformers 4.x style)."""

import json
from pathlib import Path

import pytest

from megatron_kl.config import validate_parallel
from megatron_kl.constraints import paths_unchecked
from megatron_kl.models import hf
from megatron_kl.train.config import load_train_config as _load

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["qwen2.5-7b", "llama-3.1-8b-instruct", "qwen3-4b-instruct-2507"]


def load_train_config(path, overrides=None):
    """The paper configs name their cluster's model paths (/models/...): checked where the job starts."""
    with paths_unchecked():
        return _load(path, overrides)


@pytest.mark.parametrize("name", NAMES)
def test_paper_config_matches_hf_config_and_fits_8_gpus(name):
    cfg = load_train_config(str(ROOT / "configs" / "paper" / f"{name}.yaml"))
    real = json.loads((ROOT / "tests" / "data" / "hf_configs" / f"{name}.json").read_text())
    hf.check_model_config(hf.model_config_from_hf(real), cfg.model, f"{name} config.json")
    validate_parallel(cfg.model, cfg.parallel, 8)
    assert cfg.init.hf_checkpoint and cfg.task.math.tokenizer == cfg.init.hf_checkpoint
    assert cfg.checkpoint.export_hf and not cfg.warm_start.enabled
    # the exported config.json of this model config reads back as the same model
    hf.check_model_config(hf.model_config_from_hf(hf.hf_config_from_model(cfg.model)), cfg.model)
    # LLM vocabularies take the fused log-prob path for microbatches of a few long (4k-token) responses
    from megatron_kl.models.pipeline import VocabOptions

    tp = cfg.parallel.tensor_parallel
    local_vocab = cfg.model.padded_vocab_size(tp) // tp
    assert VocabOptions.for_model(cfg.model, cfg.parallel).use_fused(8192, local_vocab)


def test_gpu_study_crosses_every_kl_configuration_and_each_run_is_launchable():
    """configs/study/qwen2.5-7b.yaml: the crossed estimator x placement x level grid, every off-policy
    correction, every RPG divergence, several coefficients, async runs, >= 2 seeds; each run passes the
    trainer's cross-field checks and the Slurm launcher's checks (disaggregated servers for the async runs)."""
    import itertools

    from megatron_kl.kl.config import ESTIMATORS, LEVELS, OFF_POLICY, PLACEMENTS
    from megatron_kl.kl.rpg import DIVERGENCES
    from megatron_kl.launch.experiment import plan
    from megatron_kl.launch.jobs import _check_slurm
    from megatron_kl.train.checks import validate_train_config

    launch_plan = plan(
        str(ROOT / "configs" / "study" / "qwen2.5-7b.yaml"),
        ["launch.slurm.account=acct", "launch.slurm.container_image=nvcr.io/megatron-kl:gpu"],
    )
    configs = [spec.cfg for spec in launch_plan.tasks]
    assert len({spec.name for spec in launch_plan.tasks}) == len(configs)
    assert len(launch_plan.study.seeds) >= 2
    for cfg in configs:
        gpus = cfg.launch.slurm.nodes * cfg.launch.slurm.gpus_per_node
        validate_train_config(
            cfg, cfg.model.vocab_size, gpus // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)
        )
        _check_slurm(cfg)
    kl_runs = [c.kl for c in configs if c.algo.loss != "rpg" and c.kl.coef > 0]
    on_policy = {(k.estimator, k.placement, k.level) for k in kl_runs if k.off_policy == "none"}
    assert on_policy == set(itertools.product(ESTIMATORS, PLACEMENTS, LEVELS))
    assert {k.off_policy for k in kl_runs} == set(OFF_POLICY)
    assert len({k.coef for k in kl_runs}) >= 3 and any(c.kl.coef == 0 and c.algo.loss != "rpg" for c in configs)
    assert {c.algo.rpg.divergence for c in configs if c.algo.loss == "rpg"} == set(DIVERGENCES)
    async_runs = [c for c in configs if c.train.staleness > 0]
    assert async_runs and all(c.launch.rollout_servers.mode == "disaggregated" for c in async_runs)


def test_moe_paper_config_matches_hf_config_and_fits_4_nodes():
    """configs/paper/qwen3-30b-a3b.yaml: the model section is Qwen3-30B-A3B's config.json (128 experts, top-8
    renormalised, width 768), the layout validates on its 4 x 8 GPUs (EP=8 within each PP stage) and trains
    (no TP without sequence parallelism), and its exported config.json reads back as the same model."""
    from megatron_kl.config import validate_training_layout

    cfg = load_train_config(str(ROOT / "configs" / "paper" / "qwen3-30b-a3b.yaml"))
    real = json.loads((ROOT / "tests" / "data" / "hf_configs" / "qwen3-30b-a3b.json").read_text())
    hf.check_model_config(hf.model_config_from_hf(real), cfg.model, "qwen3-30b-a3b config.json")
    gpus = cfg.launch.slurm.nodes * cfg.launch.slurm.gpus_per_node
    assert gpus == 32 and cfg.model.moe.num_experts == 128 and cfg.parallel.expert_parallel == 8
    validate_parallel(cfg.model, cfg.parallel, gpus)
    validate_training_layout(cfg.model, cfg.parallel, cfg.train.micro_batch_tokens)
    hf.check_model_config(hf.model_config_from_hf(hf.hf_config_from_model(cfg.model)), cfg.model)
    # the layout's parameter arithmetic as the file states it: ~2.6B parameters per GPU
    m = cfg.model.resolved()
    experts = m.num_layers * m.moe.num_experts * 3 * m.hidden_size * m.moe.ffn_hidden_size
    attention = m.num_layers * m.hidden_size * m.kv_channels * (2 * m.num_attention_heads + 2 * m.num_query_groups)
    per_gpu = (
        experts / cfg.parallel.pipeline_parallel / cfg.parallel.expert_parallel
        + attention / cfg.parallel.pipeline_parallel
        + m.vocab_size * m.hidden_size
    )
    assert 2.5e9 < per_gpu < 2.8e9 and 28.9e9 < experts < 29.1e9


def test_moe_study_preset_runs_are_launchable():
    """configs/study/qwen3-30b-a3b.yaml: every (configuration, seed) passes the trainer's checks and the Slurm
    launcher's on 4 nodes."""
    from megatron_kl.launch.experiment import plan
    from megatron_kl.launch.jobs import _check_slurm
    from megatron_kl.train.checks import validate_train_config

    launch_plan = plan(
        str(ROOT / "configs" / "study" / "qwen3-30b-a3b.yaml"),
        ["launch.slurm.account=acct", "launch.slurm.container_image=nvcr.io/megatron-kl:gpu"],
    )
    assert len(launch_plan.tasks) == 12 and len(launch_plan.study.seeds) == 2
    for spec in launch_plan.tasks:
        cfg = spec.cfg
        assert cfg.launch.slurm.nodes == 4 and cfg.model.moe.num_experts == 128
        gpus = cfg.launch.slurm.nodes * cfg.launch.slurm.gpus_per_node
        validate_train_config(
            cfg, cfg.model.vocab_size, gpus // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)
        )
        _check_slurm(cfg)


def test_long_trace_recipe_states_its_context_parallel_layout():
    """configs/paper/qwen3-4b-instruct-2507-32k.yaml: 32k-token responses on 8 GPUs as TP=2 (sequence parallel) x
    CP=2 x DP=2, the model section Qwen3-4B's; its sequences pad to the zigzag layout within the model's positions."""
    cfg = load_train_config(str(ROOT / "configs" / "paper" / "qwen3-4b-instruct-2507-32k.yaml"))
    real = json.loads((ROOT / "tests" / "data" / "hf_configs" / "qwen3-4b-instruct-2507.json").read_text())
    hf.check_model_config(hf.model_config_from_hf(real), cfg.model, "qwen3-4b-instruct-2507 config.json")
    validate_parallel(cfg.model, cfg.parallel, 8)
    assert cfg.parallel.context_parallel == 2 and cfg.parallel.sequence_parallel
    assert cfg.rollout.sampling.max_new_tokens >= 32768 and cfg.rollout.engine == "sglang"
    longest = cfg.task.math.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    padded = -(-longest // cfg.parallel.sequence_multiple) * cfg.parallel.sequence_multiple
    assert padded <= cfg.model.max_position_embeddings
    data_parallel = 8 // (cfg.parallel.tensor_parallel * cfg.parallel.context_parallel)
    assert data_parallel == 2 and (cfg.train.prompts_per_step * cfg.train.group_size) % data_parallel == 0


# the new families' recipes: (paper config, its config.json under tests/data/hf_configs, GPUs, parameters per GPU)
FAMILY_RECIPES = {
    "moonlight-16b-a3b": ("moonlight-16b-a3b", 16, (3.2e9, 3.5e9)),
    "gpt-oss-20b": ("gpt-oss-20b-bf16", 16, (4.1e9, 4.3e9)),
}


def _parameters_per_gpu(cfg) -> tuple[float, float]:
    """(routed-expert parameters in all, parameters one GPU holds) of the recipe's layout, counted from its shapes."""
    m, p = cfg.model.resolved(), cfg.parallel
    moe, width = m.moe, m.moe.ffn_hidden_size or m.ffn_hidden_size
    sparse_layers = m.num_layers - moe.first_dense_layers
    per_expert = 3 * m.hidden_size * width + (2 * width + m.hidden_size if m.linear_bias else 0)
    experts = sparse_layers * moe.num_experts * per_expert
    if m.multi_latent_attention:
        mla = m.mla
        attention = (
            m.hidden_size * m.num_attention_heads * mla.query_head_dim
            + m.hidden_size * (mla.kv_lora_rank + mla.qk_rope_head_dim)
            + mla.kv_lora_rank * m.num_attention_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            + m.num_attention_heads * mla.v_head_dim * m.hidden_size
        )
    else:
        attention = m.hidden_size * m.kv_channels * (2 * m.num_attention_heads + 2 * m.num_query_groups)
    dense = (
        m.num_layers * attention
        + sparse_layers * 3 * m.hidden_size * moe.shared_expert_ffn_hidden_size
        + moe.first_dense_layers * 3 * m.hidden_size * m.ffn_hidden_size
        + 2 * m.vocab_size * m.hidden_size
    )
    return experts, experts / p.pipeline_parallel / p.expert_parallel + dense / p.pipeline_parallel


@pytest.mark.parametrize("name", list(FAMILY_RECIPES))
def test_new_family_recipes_match_their_config_json_fit_their_gpus_and_launch(name):
    """configs/paper/{moonlight-16b-a3b, gpt-oss-20b}.yaml: the model section is the model's config.json (DeepSeek-V3's
    and GPT-OSS's architectures), the layout validates and trains on 2 x 8 GPUs, the parameter count per GPU the file
    states follows from the shapes, the exported config.json reads back as the same model; every run of the study
    preset passes the trainer's and the Slurm launcher's checks (what `launch slurm --dryrun` runs)."""
    from megatron_kl.config import validate_training_layout
    from megatron_kl.launch.experiment import plan
    from megatron_kl.launch.jobs import _check_slurm
    from megatron_kl.train.checks import validate_train_config

    json_name, gpus, (low, high) = FAMILY_RECIPES[name]
    cfg = load_train_config(str(ROOT / "configs" / "paper" / f"{name}.yaml"))
    real = json.loads((ROOT / "tests" / "data" / "hf_configs" / f"{json_name}.json").read_text())
    hf.check_model_config(hf.model_config_from_hf(real), cfg.model, f"{json_name} config.json")
    assert cfg.launch.slurm.nodes * cfg.launch.slurm.gpus_per_node == gpus
    validate_parallel(cfg.model, cfg.parallel, gpus)
    validate_training_layout(cfg.model, cfg.parallel, cfg.train.micro_batch_tokens)
    hf.check_model_config(hf.model_config_from_hf(hf.hf_config_from_model(cfg.model)), cfg.model)
    experts, per_gpu = _parameters_per_gpu(cfg)
    assert low < per_gpu < high, per_gpu
    launch_plan = plan(
        str(ROOT / "configs" / "study" / f"{name}.yaml"),
        ["launch.slurm.account=acct", "launch.slurm.container_image=nvcr.io/megatron-kl:gpu"],
    )
    assert len(launch_plan.tasks) == 12
    for spec in launch_plan.tasks:
        layout = spec.cfg.parallel
        validate_train_config(
            spec.cfg, spec.cfg.model.vocab_size, gpus // (layout.tensor_parallel * layout.pipeline_parallel)
        )
        _check_slurm(spec.cfg)


def test_deepseek_v3_671b_is_refused_by_the_layout_check_naming_the_layers():
    """DeepSeek-V3 itself: 61 layers split over no pipeline of more than one stage evenly; the check says so."""
    from megatron_kl.config import ConfigError, ParallelConfig

    real = json.loads((ROOT / "tests" / "data" / "hf_configs" / "moonlight-16b-a3b.json").read_text())
    v3 = hf.model_config_from_hf({**real, "num_hidden_layers": 61, "first_k_dense_replace": 3})
    with pytest.raises(ConfigError, match="model.num_layers=61 must be divisible by parallel.pipeline_parallel"):
        validate_parallel(v3, ParallelConfig(pipeline_parallel=8, expert_parallel=8), 64)
