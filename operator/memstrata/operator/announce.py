"""Events for what a job's runtime reported into its status: a checkpoint written, an attempt resumed. Pure.

The runtime writes status.checkpoint and status.progress (memstrata.api.report); it cannot post events
(its ServiceAccount may patch its job's status and nothing else) and its fields cannot say whether the
user has been told. So the operator tells, once per checkpoint and once per resumed attempt, and keeps
what it last told in status (`announcedCheckpoint`, `announcedResume`, fields only the operator writes),
in the same patch that the reconciler applies before it posts the events: a reconcile that is run again,
or an operator that restarts, sees the mark and says nothing twice; a patch that fails posts nothing.
"""
from __future__ import annotations

from typing import Any, Mapping, TypeVar

from pydantic import ValidationError

from memstrata.api.base import ApiModel
from memstrata.api.jobstatus import CheckpointStatus, Progress
from memstrata.api.report import format_duration
from memstrata.api.units import format_bytes
from memstrata.operator.actions import Event
from memstrata.operator.conditions import StatusBuilder

CHECKPOINT_MARK = "announcedCheckpoint"  # the step of the checkpoint last announced
RESUME_MARK = "announcedResume"  # the (0-based) attempt whose resume was last announced
M = TypeVar("M", bound=ApiModel)


def _read(model: type[M], value: Any) -> M | None:
    """The runtime's field as its model, or None when absent or not what the model says (the CRD's schema
    checks it, but a hand edit may not: a field we cannot read is announced by nobody, never an error)."""
    if not isinstance(value, Mapping):
        return None
    try:
        return model.model_validate(value)
    except ValidationError:
        return None


def describe_checkpoint(ckpt: CheckpointStatus) -> str:
    took = f"{ckpt.seconds:.1f}s" if ckpt.seconds < 60 else format_duration(ckpt.seconds)
    return f"step {ckpt.step} written to {ckpt.path} in {took}, {format_bytes(ckpt.bytes)}"


def announce(b: StatusBuilder) -> list[Event]:
    """The events the runtime's latest report calls for, with the marks that stop them recurring set in `b`."""
    events: list[Event] = []
    ckpt = _read(CheckpointStatus, b.get("checkpoint"))
    # Only a step past the last one told is news: a resumed attempt reports the (older) checkpoint it resumed
    # from, which was written and told before; the mark follows it down so that step's rewrite is told again.
    mark = b.get(CHECKPOINT_MARK)
    if ckpt is not None and ckpt.step != mark:
        b.set(CHECKPOINT_MARK, ckpt.step)
        if not isinstance(mark, int) or ckpt.step > mark:
            events.append(Event("Normal", "Checkpointed", describe_checkpoint(ckpt)))
    progress = _read(Progress, b.get("progress"))
    # Only a report that names its attempt: status.progress may still be the previous attempt's.
    if (progress is not None and progress.attempt is not None and progress.resumed_from is not None
            and progress.attempt != b.get(RESUME_MARK)):
        b.set(RESUME_MARK, progress.attempt)
        events.append(Event("Normal", "Resumed", f"attempt {progress.attempt + 1} resumed from checkpoint step "
                                                 f"{progress.resumed_from}"))
    return events
