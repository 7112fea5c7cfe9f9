"""The estimator study: a grid of KL configurations x seeds, trained and reported (``megatron-kl study``)."""
