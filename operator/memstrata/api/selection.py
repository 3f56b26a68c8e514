"""Which model a run hands back: the last step's, or the one with the lowest validation loss (`keepBest`), and
when a run stops before its last step because the validation loss stopped falling (`earlyStopping`).

Both are decided by the validation losses measured every `training.evalInterval` steps (the one before
training is the baseline, not a candidate), so both need an interval and validation data.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from memstrata.api.base import ApiModel, cel

__all__ = ["EarlyStopping", "selection_problem", "SELECTION_RULE", "EPOCHS_RULE"]


class EarlyStopping(ApiModel):
    """Stop when `patience` evaluations in a row have not lowered the best validation loss by more than
    `minDelta` (transformers' EarlyStoppingCallback)."""

    patience: int = Field(gt=0, le=10_000, description="Evaluations without improvement before the run stops.")
    min_delta: float = Field(0.0, ge=0, description="How much lower than the best a loss must be to count as "
                                                    "an improvement.")


def selection_problem(training: Any, dataset: Any) -> str | None:
    """Why `keepBest` or `earlyStopping` cannot work with this spec (None: they can, or neither is set), or why
    `epochs` cannot (a synthetic set is endless)."""
    if training.epochs is not None and dataset.synthetic is not None:
        return "training.epochs: a synthetic dataset is endless and has no epochs: set training.steps"
    wanted = [name for name, on in (("keepBest", training.keep_best),
                                    ("earlyStopping", training.early_stopping is not None)) if on]
    if not wanted:
        return None
    what = " and ".join(f"training.{name}" for name in wanted)
    if not training.eval_interval:
        return f"{what} compare validation losses: set training.evalInterval (evaluate every N steps)"
    if not (dataset.validation_split or dataset.validation_path):
        return f"{what} compare validation losses: set dataset.validationSplit or dataset.validationPath"
    return None


EPOCHS_RULE = cel("!has(self.training.epochs) || !has(self.dataset.synthetic)",
                  "training.epochs: a synthetic dataset is endless and has no epochs: set training.steps")
SELECTION_RULE = cel(
    "!((has(self.training.keepBest) && self.training.keepBest) || has(self.training.earlyStopping)) || "
    "(has(self.training.evalInterval) && self.training.evalInterval > 0 && (has(self.dataset.validationPath) || "
    "(has(self.dataset.validationSplit) && self.dataset.validationSplit > 0.0)))",
    "training.keepBest and training.earlyStopping compare validation losses: set training.evalInterval and "
    "dataset.validationSplit or dataset.validationPath")
