"""The learning-rate schedule of spec.training.schedule, as Hugging Face's schedulers compute it.

`lr_multiplier` is the pure rule: the factor on training.learningRate after `step`
optimizer steps have been taken. Warmup rises linearly from 0 (the first step
runs at 0, as in transformers' `get_*_schedule_with_warmup`), then the rate stays
constant or decays (linearly or along a half cosine) to minLearningRateRatio at
training.steps. `build_scheduler` wraps it in a torch `LambdaLR` that DeepSpeed
steps after every optimizer step it applies (a skipped fp16 overflow step does
not advance it), and saves with the engine's checkpoints.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from memstrata.api.finetunejob import LearningRateSchedule, Training

if TYPE_CHECKING:
    import torch


def lr_multiplier(step: int, schedule: LearningRateSchedule, total_steps: int) -> float:
    """The factor on the peak learning rate once `step` optimizer steps are done (0 before the first)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warmup = schedule.warmup(total_steps)
    if step < warmup:
        return step / warmup
    if schedule.type == "constant":
        return 1.0
    # max(1, ...): a schedule that is all warmup has nothing to decay over (transformers guards the same way).
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if schedule.type == "linear":
        remaining = 1.0 - progress
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = schedule.min_learning_rate_ratio
    return floor + (1.0 - floor) * remaining


def build_scheduler(optimizer: "torch.optim.Optimizer",
                    training: Training) -> "torch.optim.lr_scheduler.LambdaLR":
    """A LambdaLR over `optimizer` (whose groups hold the peak rate) following training.schedule."""
    from torch.optim.lr_scheduler import LambdaLR

    schedule, total = training.schedule, training.steps

    # A plain function, not a bound object: LambdaLR's state_dict then holds only the step count and the
    # base rates, so a checkpoint never pickles the spec.
    def factor(step: int) -> float:
        return lr_multiplier(step, schedule, total)

    return LambdaLR(optimizer, factor)


def describe(schedule: LearningRateSchedule, total_steps: int) -> str:
    """The schedule in a few words for the final report: 'cosine to 0.1x, 10 warmup steps'."""
    words: str = schedule.type
    if schedule.type != "constant":
        words += f" to {schedule.min_learning_rate_ratio:g}x"
    if warmup := schedule.warmup(total_steps):
        words += f", {warmup} warmup step{'s' if warmup != 1 else ''}"
        if schedule.warmup_ratio:
            words += f" ({schedule.warmup_ratio:g} of {total_steps})"
    return words
