"""Training from Python with a reward function of your own (docs/your-own-job.md): run it from the repository root,

    python examples/train_from_python.py [--steps N] [--output-dir DIR]

It registers a reward (the arithmetic task's exact answer, plus a small bonus for short responses), loads the CPU job's
configuration with overrides, builds the Trainer, runs the steps one by one printing each StepResult, and saves.
"""

import argparse

from megatron_kl import api
from megatron_kl.rewards import RewardInput, RewardResult, register


@register("short_and_right")
def short_and_right(sample: RewardInput, limit: int = 4) -> RewardResult:
    digits = "".join(ch for ch in sample.response if ch.isdigit() or ch == "-")
    right = float(digits == sample.answer and sample.finish_reason == "stop")
    short = float(len(sample.response_ids) <= limit)
    return RewardResult(reward=right + 0.1 * short, metrics={"right": right, "short": short})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="RL steps to run")
    parser.add_argument("--output-dir", default="runs/examples/from-python", help="the run's directory")
    args = parser.parse_args()

    cfg = api.load_config(
        "configs/cpu/default.yaml",
        [
            f"train.steps={args.steps}",
            f"train.output_dir={args.output_dir}",
            "train.prompts_per_step=8",
            "task.eval_size=16",
            "logging.progress=false",
            "reward.functions=[{name: short_and_right, kwargs: {limit: 4}}]",
        ],
    )
    with api.trainer(cfg) as trainer:
        for step in range(trainer.start_step, cfg.train.steps):
            result = trainer.step(step)
            m = result.metrics
            print(
                f"step {result.step}: reward {m['reward/mean']:.3f} (right {m['reward/extra/right']:.3f}, "
                f"short {m['reward/extra/short']:.3f}), exact KL {m['kl/exact_token']:.2e}, "
                f"engine at version {result.engine_version}"
            )
        print("saved", trainer.save())


if __name__ == "__main__":
    main()
