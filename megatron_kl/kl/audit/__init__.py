"""The KL library's audit: every KL configuration's expected gradient computed exactly on a tabular policy and
compared with the gradients of the KL targets (``exact``), the verdict the trainer logs for a run and the choice
``kl.estimator=auto`` makes (``targets``), exact training dynamics under each configuration (``dynamics``,
``figures``) and the ``megatron-kl audit`` command (``cli``)."""
