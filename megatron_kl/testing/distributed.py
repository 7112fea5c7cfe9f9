"""The tests' name for :mod:`megatron_kl.local_ranks` (spawning N gloo/nccl ranks on this machine)."""

from megatron_kl.local_ranks import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
