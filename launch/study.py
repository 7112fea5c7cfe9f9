"""Launch an estimator study (one task per configuration x seed) on a cluster of launch/clusters.py.

    python launch/study.py --cluster local --config configs/study/cpu.yaml
    python launch/study.py --cluster h100 --config configs/study/qwen2.5-7b.yaml --dryrun

Locally the study report is written when every run has ended; after a Slurm study,
`megatron-kl study --config <study.yaml> --report-only` writes it from the finished runs.
"""

import sys

from clusters import CLUSTERS

from megatron_kl.launch.recipe import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CLUSTERS, "study", __doc__))
