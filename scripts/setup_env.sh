#!/usr/bin/env bash
# Create (or reuse) .venv and install megatron-kl with the test, launch (NeMo-Run) and docs (mkdocs) extras, torch pinned to the CPU wheel.
# GPU machines: install into the container's Python instead (pip install -e .[gpu,test]).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints-cpu.txt -e ".[test,launch,docs]"
