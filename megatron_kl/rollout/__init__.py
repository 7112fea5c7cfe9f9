"""Rollout engines behind one protocol (:mod:`megatron_kl.rollout.engine`)."""
