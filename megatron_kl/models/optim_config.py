"""The optimizer's configuration (``optim:``), without torch: Adam's hyperparameters, clipping, the LR
schedule and which Adam kernel runs; ``models/optim.py`` builds megatron-core's optimizer from it."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_kl.constraints import ConfigError, check_declared, checked

ADAM_KERNELS = ("auto", "fused", "unfused")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = checked(1e-5, ge=0)
    min_lr: float = checked(0.0, ge=0)
    weight_decay: float = checked(0.0, ge=0)
    adam_beta1: float = checked(0.9, ge=0, lt=1)
    adam_beta2: float = checked(0.999, ge=0, lt=1)
    adam_eps: float = checked(1e-8, gt=0)
    clip_grad: float = checked(1.0, ge=0, fix="0 turns clipping off")
    warmup_steps: int = checked(0, ge=0)
    decay_steps: int = checked(1000, ge=1)
    lr_decay_style: str = checked("constant", choices=LR_DECAY_STYLES)  # constant | linear | cosine
    use_distributed_optimizer: bool = False
    # Adam's kernel where megatron builds torch's Adam (no Transformer Engine / apex): fused (torch's fused kernel,
    # one pass per tensor), unfused (torch's own pick: a loop of per-tensor ops on the CPU, foreach lists on GPUs),
    # or auto = fused for 16-bit models on the CPU (float32 main weights), unfused otherwise (float32 runs keep the
    # kernel their recorded trajectories came from).
    adam_kernel: str = checked("auto", choices=ADAM_KERNELS)

    def __post_init__(self):
        check_declared(self, "optim.")
        if self.lr_decay_style != "constant" and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"optim.decay_steps={self.decay_steps} with optim.lr_decay_style={self.lr_decay_style} must "
                f"exceed optim.warmup_steps={self.warmup_steps} (the decay runs from the end of the warmup "
                "to decay_steps); raise optim.decay_steps, e.g. to train.steps x algo.minibatches x "
                "algo.ppo_epochs"
            )
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr:g} must not exceed optim.lr={self.lr:g}")
