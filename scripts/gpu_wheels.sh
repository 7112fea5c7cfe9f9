#!/usr/bin/env bash
# The wheels the GPU image lacks (it has torch, triton, transformers, pytest and no network), written to
# .gpu-wheels/ for scripts/gpu_checks.sh to install there with --no-index: megatron-core, liger-kernel (a peer
# the kernel benchmark measures), math-verify and its parsers. Python 3.12, x86_64 (the image's). About 4 MB.
#
#   bash scripts/gpu_wheels.sh [DIR]        # default .gpu-wheels
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-wheels}
python=${PYTHON:-python3}
mkdir -p "$dir"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$dir" \
    megatron-core==0.16.1 liger-kernel==0.8.5 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
    antlr4-python3-runtime==4.13.2
ls -1 "$dir"
