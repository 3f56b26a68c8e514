"""FineTuneJob (memstrata.dev/v1alpha1): what a user applies and what the operator reports.

The CRD in crds/ is generated from these models (`memstrata crd`); cross-field
rules are written twice on purpose — as pydantic validators for the CLI and as
CEL `x-kubernetes-validations` for the API server — and tests hold them together.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

from memstrata.api.architecture import PRESETS, ModelArchitecture, PresetName
from memstrata.api.base import ApiModel
from memstrata.api.units import Bytes

GROUP = "memstrata.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "memstrata.dev/v1alpha1"  # GROUP/VERSION, spelt out so its type is the Literal
KIND: Final = "FineTuneJob"
PLURAL = "finetunejobs"
SINGULAR = "finetunejob"
SHORT_NAMES = ["ftj"]

Precision = Literal["bf16", "fp16", "fp32"]
Engine = Literal["memstrata", "deepspeed"]


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    out: JsonDict = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class ModelSource(ApiModel):
    """Exactly one of `preset` or `path`; a `path` needs its `architecture` inline."""

    preset: PresetName | None = Field(None, description="A built-in model shape.")
    path: str | None = Field(None, description="A Hugging Face-format directory on a mounted volume.")
    architecture: ModelArchitecture | None = Field(
        None, description="The model's shape; required with `path`, because the operator cannot read the volume."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.preset) != has(self.path)", "set exactly one of model.preset or model.path"),
                cel("!has(self.path) || has(self.architecture)", "model.architecture is required with model.path"),
                cel("!has(self.preset) || !has(self.architecture)",
                    "model.architecture is only for model.path; a preset has a fixed shape"),
            ]
        }
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if (self.preset is None) == (self.path is None):
            raise ValueError("set exactly one of model.preset or model.path")
        if self.path is not None and self.architecture is None:
            raise ValueError("model.architecture is required with model.path")
        if self.preset is not None and self.architecture is not None:
            raise ValueError("model.architecture is only for model.path; a preset has a fixed shape")
        return self

    def shape(self) -> ModelArchitecture:
        if self.preset is not None:
            return PRESETS[self.preset]
        assert self.architecture is not None  # guaranteed by _one_source
        return self.architecture


class Dataset(ApiModel):
    """A JSONL file of {"text": ...} records on a volume, or a built-in synthetic set."""

    synthetic: Literal["copy", "arithmetic"] | None = Field(
        None, description="A built-in synthetic set with learnable structure."
    )
    path: str | None = Field(None, description="A JSONL file with one {\"text\": ...} object per line.")
    text_field: str = Field("text", min_length=1, description="The JSONL field that holds the text.")

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.synthetic) != has(self.path)", "set exactly one of dataset.synthetic or dataset.path")
            ]
        }
    )

    @model_validator(mode="after")
    def _one_source(self) -> "Dataset":
        if (self.synthetic is None) == (self.path is None):
            raise ValueError("set exactly one of dataset.synthetic or dataset.path")
        return self


class Training(ApiModel):
    method: Literal["full"] = Field("full", description="Full fine-tune (every parameter trains).")
    sequence_length: int = Field(2048, gt=0, le=1 << 20)
    micro_batch: int = Field(1, gt=0)
    gradient_accumulation: int = Field(1, gt=0)
    steps: int = Field(gt=0, description="Optimizer steps.")
    learning_rate: float = Field(1e-4, gt=0, le=1.0)
    precision: Precision = "bf16"
    seed: int = Field(1234, ge=0)


class Resources(ApiModel):
    gpus: int = Field(1, ge=0, le=64, description="GPUs per node; 0 trains on the CPU.")


class MemoryPolicy(ApiModel):
    """`mode: auto` lets the planner choose; the other fields constrain it."""

    mode: Literal["auto"] = "auto"
    engine: Engine = Field(
        "memstrata",
        description="memstrata's swap layer inside DeepSpeed ZeRO-3 (raw-NVMe extents, exact pinned buffers, "
                    "per-tensor placement), or stock DeepSpeed ZeRO-Infinity ('deepspeed', the baseline).",
    )
    require_cxl: bool = Field(False, description="Only place the job on nodes with CXL memory.")
    nvme_namespaces: int = Field(1, ge=0, le=64, description="Raw NVMe namespaces to stripe over; 0 disables NVMe.")
    pinned_memory_cap: Bytes | None = Field(None, description="Upper bound on page-locked host memory.")
    dram_budget: Bytes | None = Field(
        None, description="Most DRAM the job's offloaded state may use; the rest spills to NVMe."
    )
    dram_reserve_fraction: float = Field(
        0.10, ge=0, lt=1, description="DRAM kept free for the OS, the data loader and the page cache."
    )


class RunPolicy(ApiModel):
    backoff_limit: int = Field(3, ge=0, description="Retries after the first attempt: N means N+1 attempts.")
    active_deadline_seconds: int | None = Field(None, gt=0)
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    suspend: bool = False


class FineTuneJobSpec(ApiModel):
    model: ModelSource
    dataset: Dataset
    training: Training
    resources: Resources = Resources()
    memory: MemoryPolicy = MemoryPolicy()
    image: str = Field("ghcr.io/memstrata/runtime:0.1.0", min_length=1)
    command: list[str] | None = Field(None, min_length=1, description="Overrides the image's entrypoint.")
    run_policy: RunPolicy = RunPolicy()

    @model_validator(mode="after")
    def _fits_positions(self) -> "FineTuneJobSpec":
        shape = self.model.shape()
        if shape.family == "gpt" and self.training.sequence_length > shape.max_positions:
            raise ValueError(
                f"training.sequenceLength ({self.training.sequence_length}) exceeds the model's "
                f"{shape.max_positions} positions"
            )
        return self


class Metadata(ApiModel):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    model_config = ConfigDict(extra="ignore")


class FineTuneJob(ApiModel):
    api_version: Literal["memstrata.dev/v1alpha1"] = API_VERSION
    kind: Literal["FineTuneJob"] = KIND
    metadata: Metadata
    spec: FineTuneJobSpec
    status: "FineTuneJobStatus | None" = None


# --- status ----------------------------------------------------------------------------------------

Phase = Literal["Pending", "Created", "Scheduled", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
ConditionType = Literal["Created", "Scheduled", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]


class Condition(ApiModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: datetime


class Progress(ApiModel):
    step: int = Field(0, ge=0)
    total: int = Field(0, ge=0)
    loss: float | None = None
    tokens_per_second: float | None = None
    percent: int = Field(0, ge=0, le=100)
    eta_seconds: float | None = None
    eta: str | None = Field(None, description="The ETA for `kubectl get ftj`, e.g. 12m30s.")
    summary: str | None = Field(None, description="step/total (percent), for `kubectl get ftj`.")


class FineTuneJobStatus(ApiModel):
    phase: Phase | None = None
    conditions: list[Condition] = []
    node: str | None = None
    plan: dict[str, Any] | None = Field(None, description="The plan for the chosen node (memstrata.plan.Plan).")
    progress: Progress | None = None
    peak_memory: dict[str, int] | None = Field(None, description="Peak bytes per stratum, reported by the runtime.")
    start_time: datetime | None = None
    completion_time: datetime | None = None
    restarts: int = 0
    message: str | None = None
    model_config = ConfigDict(extra="allow")


FineTuneJob.model_rebuild()
