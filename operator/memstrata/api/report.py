"""RuntimeReport: what the runtime in the pod reports back about its progress.

The runtime patches it into the FineTuneJob's `status.progress`,
`status.peakMemory` and, once it has saved the model, `status.output`, through a
ServiceAccount that may patch only its own job's status; locally the same payload
feeds the progress bar and the final report. Global rank 0 sends those; each pod
(its local rank 0) also sends its own `status.workers["<node rank>"]`, and a pod
without global rank 0 sends that entry alone (`status_patch(job=False)`).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from memstrata.api.base import ApiModel
from memstrata.api.jobstatus import CheckpointStatus, OutputStatus, Progress, ResultStatus, WorkerStatus, status_path

RuntimeStage = Literal["initializing", "training", "finished", "failed"]


# The only status fields a job's runtime writes (status_patch); every other one is the operator's.
# charts/memstrata/templates/runtime-status-policy.yaml enforces it at the API server.
RUNTIME_STATUS_FIELDS = ("progress", "peakMemory", "output", "checkpoint", "result", "workers")


class StratumCounters(ApiModel):
    peak_bytes: int = Field(0, ge=0)
    bytes_written: int = Field(0, ge=0)
    bytes_read: int = Field(0, ge=0)


class RuntimeReport(ApiModel):
    stage: RuntimeStage
    step: int = Field(0, ge=0)
    total_steps: int = Field(0, ge=0)
    loss: float | None = None
    validation_loss: float | None = None
    learning_rate: float | None = None
    resumed_from: int | None = Field(None, description="The checkpoint step this attempt resumed from.")
    attempt: int | None = Field(None, ge=0, description="The pod attempt (0-based) reporting; set by the pod "
                                                        "entrypoint, absent in a local run.")
    tokens_per_second: float | None = None
    elapsed_seconds: float = Field(0, ge=0)
    metrics_path: str | None = Field(None, description="Where the metrics are written (the leader's).")
    strata: dict[str, StratumCounters] = Field(default_factory=dict, description="Keyed by hbm/dram/cxl/nvme.")
    message: str | None = None
    output: OutputStatus | None = Field(None, description="The fine-tuned model, once saved.")
    checkpoint: CheckpointStatus | None = Field(None, description="The latest complete checkpoint.")
    result: ResultStatus | None = Field(None, description="The final losses, once training has finished.")
    node_rank: int | None = Field(None, ge=0, description="The reporting pod's node rank (PET_NODE_RANK): the key "
                                                          "of its status.workers entry.")
    worker: WorkerStatus | None = Field(None, description="The reporting pod's own status.workers entry (all of "
                                                          "its ranks together).")

    @property
    def eta_seconds(self) -> float | None:
        done = self.step - (self.resumed_from or 0)  # the steps this attempt took in elapsed_seconds
        if done <= 0 or self.total_steps <= self.step:
            return 0.0 if self.total_steps and self.step >= self.total_steps else None
        return self.elapsed_seconds / done * (self.total_steps - self.step)

    def progress(self) -> Progress:
        """The FineTuneJob status.progress this report implies."""
        percent = int(100 * self.step / self.total_steps) if self.total_steps else 0
        eta = self.eta_seconds
        return Progress(
            step=self.step,
            total=self.total_steps,
            loss=self.loss,
            validation_loss=self.validation_loss,
            learning_rate=self.learning_rate,
            resumed_from=self.resumed_from,
            attempt=self.attempt,
            tokens_per_second=self.tokens_per_second,
            percent=min(percent, 100),
            eta_seconds=eta,
            eta=format_duration(eta) if eta is not None else None,
            summary=f"{self.step}/{self.total_steps} ({min(percent, 100)}%)",
            metrics_path=status_path(self.metrics_path) if self.metrics_path else None,
        )

    def status_patch(self, *, job: bool = True) -> dict[str, object]:
        """The merge patch of the job's status subresource. status.progress is replaced whole: its unset fields
        go as null, which a merge patch deletes, so nothing a previous attempt reported (resumedFrom, a loss)
        stays behind as if this attempt had said it; so is this pod's status.workers entry, the only key of
        status.workers it touches (the other pods' entries are theirs). `job=False`: that entry alone (a pod
        without global rank 0)."""
        patch: dict[str, object] = {}  # RUNTIME_STATUS_FIELDS
        if self.worker is not None and self.node_rank is not None:
            patch["workers"] = {str(self.node_rank): self.worker.model_dump(mode="json", by_alias=True)}
        if not job:
            return {"status": patch}
        peak = {name: c.peak_bytes for name, c in self.strata.items() if c.peak_bytes}
        patch["progress"] = self.progress().model_dump(mode="json", by_alias=True)
        if peak:
            patch["peakMemory"] = peak
        if self.output is not None:
            patch["output"] = self.output.wire()
        if self.checkpoint is not None:
            patch["checkpoint"] = self.checkpoint.wire()
        if self.result is not None:
            patch["result"] = self.result.wire()
        return {"status": patch}


def format_duration(seconds: float) -> str:
    """12s, 4m05s, 2h03m — compact, for a kubectl column."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
