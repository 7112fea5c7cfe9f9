"""Exact gradient audit of every KL configuration; see megatron_kl/kl/audit/exact.py.

python tools/grad_audit.py --vocab 3 --length 3 --seed 0 [--truncate 2.0] [--json out.json]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_kl.kl.audit.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
