"""Node checks that ship with the package: the sharded-correctness tests a new cluster node must pass
(vocab-parallel kernels and the fused output layer against float64 references, TP / PP / VPP model layouts
against one rank, the Transformer Engine layouts on GPUs), written as pytest modules so that the same code is
the repository's test and ``megatron-kl validate``'s check on an installed package
(``python -m pytest --pyargs megatron_kl.validation``)."""
