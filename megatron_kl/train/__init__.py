"""The RL trainer: config, warm start, rollouts, the RL step, evaluation, checkpoints, metrics."""
