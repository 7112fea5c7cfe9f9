"""Launch one training job on a cluster of launch/clusters.py (NeMo-Run; the same code as `megatron-kl launch`).

python launch/train.py --cluster local --config configs/cpu/default.yaml
python launch/train.py --cluster h100 --config configs/paper/qwen2.5-7b.yaml launch.slurm.nodes=4 --dryrun
"""

import sys

from clusters import CLUSTERS

from megatron_kl.launch.recipe import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CLUSTERS, "train", __doc__))
