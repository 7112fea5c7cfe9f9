"""Validate one node: the GPU tests, TP/PP layouts (Transformer Engine + NCCL), the vocab-parallel and fused-linear
kernels at TP=8, and 3 training steps with SGLang rollouts and NCCL weight sync; a pass/fail table and JSON.

    python launch/validate.py                                   # here (CPU: the CPU subset)
    python launch/validate.py --cluster h100 --dryrun           # the sbatch script of a one-node job
    python launch/validate.py --cluster h100 launch.slurm.partition=h100-debug
"""

import sys

from clusters import CLUSTERS

from megatron_kl.launch.node_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CLUSTERS, prog="launch/validate.py"))
