"""`training.epochs`: passes over the data, turned into the optimizer steps the rest of the run counts in.

One pass is every training record of every dataset once (a mix: each set once, whatever its weight), tokenized
and packed (or padded) as training packs them; its sequences, over the sequences one optimizer step takes
(micro-batch x accumulation x ranks), times the epochs, rounded up, are the run's steps. Packing boundaries move
a little with the order each epoch is shuffled in, so the run report says how many passes the steps really
made (`TrainData.epochs_done`).
"""
from __future__ import annotations

import math

from memstrata.api.bounds import MAX_STEPS
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.runtime.train.data.pipeline import TrainData
from memstrata.runtime.train.preflight import RecipeError

__all__ = ["with_epoch_steps"]


def with_epoch_steps(spec: FineTuneJobSpec, data: TrainData, world: int) -> FineTuneJobSpec:
    """`spec` with training.steps set from training.epochs and the sequences of one pass over `data`."""
    t = spec.training
    assert t.epochs is not None
    per_step = t.micro_batch * t.gradient_accumulation * world
    sequences = data.sequences_per_epoch()
    steps = max(1, math.ceil(t.epochs * sequences / per_step))
    if steps > MAX_STEPS:
        raise RecipeError(f"training.epochs {t.epochs:g}: {steps} steps of {per_step} sequences "
                          f"({sequences} a pass), more than {MAX_STEPS}")
    warmup = t.schedule.warmup(steps)
    if warmup > steps:
        raise RecipeError(f"training.schedule.warmupSteps: {warmup} is more than the {steps} steps that "
                          f"training.epochs {t.epochs:g} takes ({sequences} sequences a pass, {per_step} a step)")
    data.summary += (f"; {t.epochs:g} epochs of {sequences} sequences = {steps} steps of {per_step} "
                     f"sequences")
    return spec.model_copy(update={"training": t.model_copy(update={"steps": steps})})
