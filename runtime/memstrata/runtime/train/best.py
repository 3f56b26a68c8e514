"""The model a run hands back, chosen by validation loss (`training.keepBest`), and when it stops early
(`training.earlyStopping`).

Every evaluation after a step is a candidate. With keepBest, a candidate that beats the best so far is exported
at once, whole, to a hidden directory beside the output (`.<name>.best-step-NNNNNNNN`, the same atomic export as
the final model), and the previous best is removed only after it is complete; at the end the best is renamed
into `output.path`. So the best model costs one export per improvement, never a second copy of the training
state, and survives a killed run: a resumed run adopts the newest complete one up to its checkpoint's step (a
later one is from steps it will train again, bit for bit, and is removed).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memstrata.api.checkpoint import SelectionState
from memstrata.api.finetunejob import Training
from memstrata.runtime.train.model.export import (RUN_FILE, check_output_path, fsync_dir, mark_run_complete,
                                                  reclaim_partials)

__all__ = ["Selection", "Best", "reclaim_best_partials"]

Save = Callable[[Path, int, float], object]  # (directory, step, validation loss): export the model there


def _best_prefix(output: Path) -> Path:
    """Where the best models of `output` are staged, less their step: `.<name>.best-step-`."""
    return output.parent / f".{output.name}.best-step-"


def reclaim_best_partials(output: Path) -> list[Path]:
    """The partial exports of a best model that runs killed mid-export left beside `output`, removed."""
    return reclaim_partials(_best_prefix(output), any_suffix=True)


@dataclass(frozen=True)
class Best:
    step: int
    loss: float
    path: Path | None  # the exported model (keepBest), else None


class Selection:
    """Follows the validation losses of a run; `stop_reason` says when early stopping ends it."""

    def __init__(self, training: Training, output: Path | None, *, leader: bool, resumed_step: int = 0,
                 resumed: SelectionState | None = None) -> None:
        self.keep = training.keep_best and output is not None
        self.early = training.early_stopping
        self.output, self.leader = output, leader
        self.best: Best | None = None
        self.waiting = 0  # evaluations since the best
        self.stop_reason: str | None = None
        self.published = False  # the output is the best model (publish renamed it there)
        if self.keep:
            self.best = self._adopt(resumed_step)
        if resumed is not None:  # the checkpoint's count: patience goes on from where it stood
            self.waiting = resumed.waiting
            if self.best is None and resumed.best_step is not None and resumed.best_loss is not None:
                self.best = Best(resumed.best_step, resumed.best_loss, None)

    def state(self) -> SelectionState:
        """What a checkpoint records of the choice so far."""
        best = self.best
        return SelectionState(best_step=best.step if best else None, best_loss=best.loss if best else None,
                              waiting=self.waiting)

    def _staged(self) -> list[tuple[int, Path]]:
        assert self.output is not None
        found = []
        prefix = _best_prefix(self.output)
        for path in prefix.parent.glob(f"{prefix.name}*"):
            try:
                found.append((int(path.name.rsplit("-", 1)[1]), path))
            except ValueError:
                continue
        return sorted(found)

    def _adopt(self, resumed_step: int) -> Best | None:
        """The newest complete best a killed attempt exported up to `resumed_step`; later ones go."""
        best = None
        for step, path in self._staged():
            if step > resumed_step:
                if self.leader:
                    shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                loss = json.loads((path / RUN_FILE).read_text())["validationLoss"]
            except (OSError, ValueError, KeyError):
                continue
            best = Best(step, float(loss), path)
        return best

    def observe(self, step: int, loss: float, save: Save) -> bool:
        """Take the validation loss after `step`; exports the model with `save` when it is the new best (every
        rank calls this: the export gathers). True when it is."""
        minimum = self.early.min_delta if self.early is not None else 0.0
        if self.best is not None and not loss < self.best.loss - minimum:
            self.waiting += 1
            if self.early is not None and self.waiting >= self.early.patience:
                self.stop_reason = (f"the validation loss did not improve on {self.best.loss:.4f} (step "
                                    f"{self.best.step}) for {self.waiting} evaluations (earlyStopping.patience)")
            return False
        previous, self.waiting = self.best, 0
        path = None
        if self.keep:
            assert self.output is not None
            path = Path(f"{_best_prefix(self.output)}{step:08d}")
            save(path, step, loss)
            if self.leader and previous is not None and previous.path is not None:
                shutil.rmtree(previous.path, ignore_errors=True)
        self.best = Best(step, loss, path)
        return True

    def publish(self, run_steps: int) -> Best | None:
        """Rename the best model into the output path (keepBest), marked as the output of a run that ended after
        `run_steps`; None when there is none to publish."""
        if not self.keep or self.best is None or self.best.path is None or self.output is None:
            return None
        if self.leader:
            check_output_path(self.output)
            mark_run_complete(self.best.path, run_steps)
            self.best.path.rename(self.output)
            fsync_dir(self.output.parent)
        self.published = True
        return self.best
