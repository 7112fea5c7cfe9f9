"""Vocab-parallel statistics (used by the KL library, the models and the rollout engines): per-position statistics of
the softmax over a vocabulary sharded across tensor-parallel ranks - log-probs of the targets, entropy, the exact KL
to the reference - from logits (``stats``) or from hidden states and the output weight without materialising the logits
(``fused_linear``), under the sampler's top-k / top-p truncation (``truncation``, with the top-p search in C,
``native``, ``top_p_histogram``), and their Triton versions for GPUs (``triton_stats``, ``triton_kernels``)."""
