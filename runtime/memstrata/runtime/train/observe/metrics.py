"""Per-step metrics on disk: `metrics.jsonl` and TensorBoard event files in spec.output's metrics directory.

One JSON object per optimizer step (and one for the validation loss measured
before the first step), written and flushed as the step ends, so a killed run
leaves every step it finished. The same numbers go to TensorBoard through
`torch.utils.tensorboard`. A run resumed from step k first cuts both back to
step k: metrics.jsonl is rewritten (temp file, then rename) without the steps
after k, and the event writer opens with purge_step k+1, which makes TensorBoard
drop the earlier attempt's events from k+1 on, so replayed steps never appear
twice. A fresh run (no resume step) starts both anew.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from pydantic import BaseModel

from memstrata.api.jobstatus import CheckpointStatus

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

METRICS_FILE = "metrics.jsonl"


@dataclass
class StepResult:
    """What one optimizer step measured: made by the recipe, written here, reported by the run."""

    step: int
    loss: float
    seconds: float
    tokens: int
    validation_loss: float | None = None
    learning_rate: float | None = None  # the rate this step's update was made with
    grad_norm: float | None = None  # DeepSpeed's global gradient norm before clipping (None if it gives none)
    checkpoint: CheckpointStatus | None = None  # the checkpoint written after this step, if one was
    checkpoint_error: str | None = None  # why the checkpoint due after this step could not be written
    sample: str | None = None  # the model's answer to training.evalSamplePrompt, at an evaluation

# TensorBoard tag of each record field that is plotted.
TAGS = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "tokens_per_second": "train/tokens_per_second",
    "grad_norm": "train/grad_norm",
    "validation_loss": "validation/loss",
}


class MetricsError(ValueError):
    """The metrics directory cannot be written; the message names the field and the path."""


class MetricsRecord(BaseModel):
    """One line of metrics.jsonl; fields not measured at that step are left out of the line."""

    step: int
    loss: float | None = None
    validation_loss: float | None = None
    learning_rate: float | None = None
    tokens: int | None = None
    tokens_per_second: float | None = None
    seconds: float | None = None
    grad_norm: float | None = None
    sample: str | None = None
    # Per step: what each stratum holds, the bytes moved each way and their bandwidth, the phase times, the swap
    # layer's prefetch hits and I/O-token waits (memstrata.runtime.train.observe.strata), by TensorBoard tag.
    strata: dict[str, float] | None = None
    wall_time: float


def check_metrics_dir(path: Path, field: str = "spec.output.metricsPath") -> None:
    """Refuse, before training, a metrics directory that cannot be created or written (nothing is left
    behind: the probe is removed)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise MetricsError(f"{field}: {path}: cannot create it: {existing} is not a directory")
    try:  # really try: permission bits say nothing about a read-only mount, or to root
        os.rmdir(tempfile.mkdtemp(prefix=".metrics.probe-", dir=existing))
    except OSError as exc:
        raise MetricsError(f"{field}: {path}: cannot write in {existing}: {exc.strerror or exc}") from None


def _kept_lines(path: Path, through: int) -> list[str]:
    """metrics.jsonl's lines for steps <= `through`; a torn last line (a kill mid-write) is dropped."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int) and step <= through:
            kept.append(line + "\n")
    return kept


def _replace(path: Path, lines: list[str]) -> None:
    """Write `lines` to `path` atomically: a kill leaves the old file or the new one, never half of it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MetricsWriter:
    """`open()` it after setup, `write_step()` every step, `close()` at the end (also on failure)."""

    def __init__(self, directory: Path, resume_step: int | None = None) -> None:
        self.directory = directory
        self.resume_step = resume_step
        self._jsonl: IO[str] | None = None
        self._tb: SummaryWriter | None = None

    @property
    def path(self) -> Path:
        return self.directory / METRICS_FILE

    def open(self) -> "MetricsWriter":
        from torch.utils.tensorboard import SummaryWriter

        # Steps after the resume point are replayed, so their old records go; a fresh run keeps none.
        through = self.resume_step if self.resume_step is not None else -1
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _replace(self.path, _kept_lines(self.path, through))
            self._jsonl = self.path.open("a")
            self._tb = SummaryWriter(log_dir=str(self.directory), purge_step=through + 1)
        except OSError as exc:
            self.close()
            raise MetricsError(f"spec.output.metricsPath: {self.directory}: {exc.strerror or exc}") from None
        return self

    def write(self, record: MetricsRecord) -> None:
        if self._jsonl is None or self._tb is None:
            raise RuntimeError("MetricsWriter.write() before open()")
        self._jsonl.write(json.dumps(record.model_dump(exclude_none=True)) + "\n")
        self._jsonl.flush()
        for name, tag in TAGS.items():
            value = getattr(record, name)
            if value is not None:
                self._tb.add_scalar(tag, value, global_step=record.step, walltime=record.wall_time)
        for tag, value in (record.strata or {}).items():
            self._tb.add_scalar(tag, value, global_step=record.step, walltime=record.wall_time)
        if record.sample is not None:
            self._tb.add_text("validation/sample", record.sample, global_step=record.step, walltime=record.wall_time)
        self._tb.flush()

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Preformatted text (the plan's table) in TensorBoard's Text tab; not in metrics.jsonl."""
        if self._tb is None:
            raise RuntimeError("MetricsWriter.write_text() before open()")
        # TensorBoard renders markdown: indented by four spaces, the table keeps its columns.
        self._tb.add_text(tag, "\n".join("    " + line for line in text.splitlines()), global_step=step)
        self._tb.flush()

    def write_step(self, s: StepResult, strata: dict[str, float] | None = None) -> None:
        """One optimizer step's record (with its strata scalars), stamped with the wall time now."""
        self.write(MetricsRecord(step=s.step, loss=s.loss, validation_loss=s.validation_loss,
                                 learning_rate=s.learning_rate, tokens=s.tokens,
                                 tokens_per_second=s.tokens / s.seconds if s.seconds else None, seconds=s.seconds,
                                 # an fp16 overflow step has an infinite norm, which JSON cannot hold
                                 grad_norm=s.grad_norm if s.grad_norm is not None and math.isfinite(s.grad_norm)
                                 else None, sample=s.sample, strata=strata, wall_time=time.time()))

    def write_validation(self, step: int, loss: float, sample: str | None = None) -> None:
        """A validation loss (and sample) measured outside a step (before the first one)."""
        self.write(MetricsRecord(step=step, validation_loss=loss, sample=sample, wall_time=time.time()))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


@dataclass
class Phases:
    """Wall-clock seconds spent in each phase of the run."""

    init: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    step: float = 0.0
    save: float = 0.0


@dataclass
class TrainResult:
    steps: list[StepResult] = field(default_factory=list)
    phases: Phases = field(default_factory=Phases)
    validation_losses: dict[int, float] = field(default_factory=dict)  # step (0: before training) -> loss
    stopped_early: str | None = None  # why the run ended before training.steps

    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]
