"""FineTuneJob (memstrata.dev/v1alpha1): what a user applies and what the operator reports.

The CRD in crds/ is generated from these models (`memstrata crd`); cross-field
rules are written twice on purpose — as pydantic validators for the CLI and as
CEL `x-kubernetes-validations` for the API server — and tests hold them together.
"""
from __future__ import annotations

from datetime import datetime
from typing import Final, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

from memstrata.api.architecture import PRESETS, ModelArchitecture, PresetName
from memstrata.api.base import ApiModel
from memstrata.api.jobstatus import OperatorStatus
from memstrata.api.lora import Lora, check_targets
from memstrata.api.strataplan import Engine
from memstrata.api.units import Bytes, GiB

GROUP = "memstrata.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "memstrata.dev/v1alpha1"  # GROUP/VERSION, spelt out so its type is the Literal
KIND: Final = "FineTuneJob"
PLURAL = "finetunejobs"
SINGULAR = "finetunejob"
SHORT_NAMES = ["ftj"]

Precision = Literal["bf16", "fp16", "fp32"]
Method = Literal["full", "lora"]


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    out: JsonDict = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class ModelSource(ApiModel):
    """Exactly one of `preset` or `path`. With `path`, `architecture` is optional: when absent, the operator
    reads the shape from the directory's config.json (an inspection pod) before planning; when present, it
    must match that file."""

    preset: PresetName | None = Field(None, description="A built-in model shape, trained from random weights.")
    path: str | None = Field(None, description="A Hugging Face-format directory (config.json, *.safetensors, "
                                                "tokenizer.json) on a mounted volume.")
    architecture: ModelArchitecture | None = Field(
        None, description="The model's shape. Optional with `path`: the operator then learns it from the volume."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.preset) != has(self.path)", "set exactly one of model.preset or model.path"),
                cel("!has(self.preset) || !has(self.architecture)",
                    "model.architecture is only for model.path; a preset has a fixed shape"),
            ]
        }
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if (self.preset is None) == (self.path is None):
            raise ValueError("set exactly one of model.preset or model.path")
        if self.preset is not None and self.architecture is not None:
            raise ValueError("model.architecture is only for model.path; a preset has a fixed shape")
        return self

    def known_shape(self) -> ModelArchitecture | None:
        """The shape, when the spec states it (a preset or an inline architecture); None when only the
        model directory knows it."""
        if self.preset is not None:
            return PRESETS[self.preset]
        return self.architecture

    def shape(self) -> ModelArchitecture:
        shape = self.known_shape()
        if shape is None:
            raise ValueError(f"model.path {self.path}: the shape is not known yet (no model.architecture, and "
                             "the model directory has not been inspected)")
        return shape


DatasetFormat = Literal["auto", "text", "prompt_completion", "messages"]


class Dataset(ApiModel):
    """A JSONL file on a volume, or a built-in synthetic set.

    Records are `{"text": ...}` (trained on every token), `{"prompt": ..., "completion": ...}` (loss on the
    completion only) or `{"messages": [{"role": ..., "content": ...}, ...]}` (the model's chat template
    applied, loss on the assistant turns only); `format: auto` takes the format of the first record.
    """

    synthetic: Literal["copy", "arithmetic"] | None = Field(
        None, description="A built-in synthetic set with learnable structure."
    )
    path: str | None = Field(None, description="A JSONL file: one text, prompt/completion or messages record "
                                                "per line.")
    format: DatasetFormat = Field("auto", description="The record format; auto: that of the first record.")
    text_field: str = Field("text", min_length=1, description="The JSONL field that holds the text (format text).")
    packing: bool = Field(True, description="Pack examples end to end into full sequences; false: one example "
                                            "per sequence, padded.")
    validation_split: float = Field(0.0, ge=0, lt=0.5, description="Fraction of the records held out for "
                                                                   "validation (chosen by record, reproducibly).")
    validation_path: str | None = Field(None, description="A separate JSONL file for validation (instead of a "
                                                          "split).")

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.synthetic) != has(self.path)", "set exactly one of dataset.synthetic or dataset.path"),
                cel("!has(self.validationPath) || !has(self.validationSplit) || self.validationSplit == 0.0",
                    "set at most one of dataset.validationSplit or dataset.validationPath"),
            ]
        }
    )

    @model_validator(mode="after")
    def _one_source(self) -> "Dataset":
        if (self.synthetic is None) == (self.path is None):
            raise ValueError("set exactly one of dataset.synthetic or dataset.path")
        if self.validation_path is not None and self.validation_split:
            raise ValueError("set at most one of dataset.validationSplit or dataset.validationPath")
        return self


class Output(ApiModel):
    """Where the fine-tuned model goes: a Hugging Face directory, written atomically at the end (with
    training.method lora: the adapter in PEFT format, and the merged model in `merged/` with lora.mergeOnSave)."""

    path: str = Field(min_length=1, description="A directory that must not exist yet, on a writable volume.")
    shard_size: Bytes = Field(2 * GiB, description="Largest safetensors shard (default 2Gi).")
    metrics_path: str | None = Field(
        None, min_length=1, description="Directory for metrics.jsonl (one line per step) and TensorBoard event "
                                        "files; default: `<path>-metrics` beside the model.")

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.metricsPath) || !(self.metricsPath == self.path || self.metricsPath.startsWith(self.path + '/'))",
        "output.metricsPath must not be output.path or inside it: the model directory is created whole at the end",
        ".metricsPath")]})

    @model_validator(mode="after")
    def _metrics_outside_model(self) -> "Output":
        if self.metrics_path is not None and _under(self.metrics_path.rstrip("/"), self.path.rstrip("/")):
            raise ValueError("output.metricsPath must not be output.path or inside it: the model directory is "
                             "created whole at the end")
        return self

    def metrics_dir(self) -> str:
        return self.metrics_path or f"{self.path.rstrip('/')}-metrics"


# Bounds on the counts of a job, far past any real one, so that a typo (steps: 1e21) is refused naming its field
# instead of being planned, scheduled and shown with an ETA of billions of hours: ten million optimizer steps
# (years of the fastest steps), 65,536 sequences per micro-batch or accumulation, and a seed every RNG takes
# (numpy's are 32-bit).
MAX_STEPS: Final = 10_000_000
MAX_BATCH: Final = 65_536
MAX_SEED: Final = (1 << 32) - 1


class Checkpoint(ApiModel):
    """Resumable training state: model (fp32 master weights), optimizer state, LR schedule, data position and
    every RNG, in one directory per step under `path`, completed by a marker file."""

    path: str = Field(min_length=1, description="A directory on a writable volume; `step-NNNNNNNN` directories "
                                                "are written under it.")
    every_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="A checkpoint every this many optimizer "
                                                                           "steps.")
    every_minutes: float | None = Field(
        None, gt=0, description="A checkpoint when this many minutes have passed since the last one (or the "
                                "start); with neither field set: every 30 minutes.")
    keep: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept; older ones are removed only after "
                                                   "a newer one is complete.")

    def due(self, step: int, minutes_since_last: float) -> bool:
        """Whether a checkpoint is due after optimizer step `step`."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        minutes = self.every_minutes if self.every_minutes is not None else (
            30.0 if self.every_steps is None else None)
        return minutes is not None and minutes_since_last >= minutes


# What the operator itself puts in the job's pod: the runtime config's volume and where it is mounted, and
# where the ServiceAccount token the runtime reports with is mounted. A user volume may not take these.
OPERATOR_VOLUMES: Final = ("runtime-config",)
OPERATOR_MOUNT_PATHS: Final = ("/etc/memstrata", "/var/run/secrets/kubernetes.io/serviceaccount")
MAX_VOLUMES = 64


def _under(path: str, root: str) -> bool:
    return path.rstrip("/") == root or path.startswith(root + "/")


class VolumeMount(ApiModel):
    """Kubernetes' VolumeMount (the fields a training container needs)."""

    name: str = Field(min_length=1, max_length=63, description="One of spec.volumes.")
    mount_path: str = Field(min_length=1, max_length=4096, pattern=r"^/", description="An absolute path.")
    read_only: bool = False
    sub_path: str | None = Field(None, max_length=4096)

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel(" && ".join(f"self.mountPath != '{p}' && !self.mountPath.startsWith('{p}/')"
                        for p in OPERATOR_MOUNT_PATHS),
            f"mountPath must not be at or under {' or '.join(OPERATOR_MOUNT_PATHS)}: the operator mounts the "
            "runtime config and the ServiceAccount token there", ".mountPath"),
    ]})

    @model_validator(mode="after")
    def _not_the_operators(self) -> "VolumeMount":
        for root in OPERATOR_MOUNT_PATHS:
            if _under(self.mount_path, root):
                raise ValueError(f"mountPath {self.mount_path}: must not be at or under {root}, where the "
                                 "operator mounts the runtime config or the ServiceAccount token")
        return self


class Volume(ApiModel):
    """Kubernetes' Volume: a `name` and one volume source (`persistentVolumeClaim`, `nfs`, `hostPath`, `csi`,
    ...), passed to the pod as written; the API server validates the source when the pod is created."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "x-kubernetes-preserve-unknown-fields": True,
        "x-kubernetes-validations": [cel(
            " && ".join(f"self.name != '{n}'" for n in OPERATOR_VOLUMES),
            f"name must not be {' or '.join(OPERATOR_VOLUMES)}: the operator's own volume in the job's pod",
            ".name")],
    })

    @model_validator(mode="after")
    def _not_the_operators(self) -> "Volume":
        if self.name in OPERATOR_VOLUMES:
            raise ValueError(f"name {self.name!r} is the operator's own volume in the job's pod "
                             "(the runtime config); choose another name")
        return self


ScheduleType = Literal["constant", "linear", "cosine"]


class LearningRateSchedule(ApiModel):
    """Linear warmup from 0 to training.learningRate, then constant, linear or cosine decay to
    `minLearningRateRatio` x learningRate at the last step (Hugging Face's schedules, with a floor)."""

    type: ScheduleType = "constant"
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Optimizer steps of linear warmup.")
    min_learning_rate_ratio: float = Field(0.0, ge=0, le=1, description="The decay's floor, as a fraction of "
                                                                        "learningRate (linear and cosine).")


class Optimizer(ApiModel):
    """AdamW (DeepSpeed's CPU Adam when the optimizer state is offloaded)."""

    type: Literal["adamw"] = "adamw"
    beta1: float = Field(0.9, ge=0, lt=1, description="Decay of the first moment.")
    beta2: float = Field(0.95, ge=0, lt=1, description="Decay of the second moment.")
    eps: float = Field(1e-8, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=10, description="Decoupled weight decay (AdamW).")


class Training(ApiModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.schedule) || !has(self.schedule.warmupSteps) || self.schedule.warmupSteps <= self.steps",
            "schedule.warmupSteps must not exceed training.steps"),
        cel("!has(self.lora) || (has(self.method) && self.method == 'lora')",
            "training.lora is only for training.method: lora", ".lora")]})

    method: Method = Field("full", description="full: every parameter trains; lora: low-rank adapters train and "
                                               "the base weights stay frozen (settings in `lora`).")
    lora: Lora | None = Field(None, description="LoRA's settings, for method: lora (defaults when absent).")
    sequence_length: int = Field(2048, gt=0, le=1 << 20)
    micro_batch: int = Field(1, gt=0, le=MAX_BATCH)
    gradient_accumulation: int = Field(1, gt=0, le=MAX_BATCH)
    steps: int = Field(gt=0, le=MAX_STEPS, description="Optimizer steps.")
    learning_rate: float = Field(1e-4, gt=0, le=1.0)
    precision: Precision = "bf16"
    seed: int = Field(1234, ge=0, le=MAX_SEED)
    activation_checkpointing: bool = Field(
        True, description="Keep one hidden state per layer and recompute the rest in backward (the planner "
                          "counts activations this way); false keeps every activation.")
    loss_chunk_tokens: int = Field(
        4096, ge=0, le=1 << 20,
        description="The loss is taken over this many tokens at a time, each chunk's logits recomputed in backward, so "
                    "the sequence x vocabulary logits never exist whole (a 32K sequence of a 128K vocabulary would be "
                    "16 GiB in fp32); 0 computes them whole, as Hugging Face does.")
    eval_interval: int = Field(0, ge=0, le=MAX_STEPS, description="Validation loss every this many steps (0: at the "
                                                                  "end only).")
    schedule: LearningRateSchedule = LearningRateSchedule()
    optimizer: Optimizer = Optimizer()
    gradient_clipping: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: no "
                                                            "clipping).")

    @model_validator(mode="after")
    def _warmup_fits(self) -> "Training":
        if self.schedule.warmup_steps > self.steps:
            raise ValueError(f"schedule.warmupSteps: {self.schedule.warmup_steps} is more than training.steps "
                             f"({self.steps})")
        return self

    @model_validator(mode="after")
    def _lora_only_with_lora(self) -> "Training":
        if self.lora is not None and self.method != "lora":
            raise ValueError(f"training.lora is only for training.method: lora (method is {self.method}): set "
                             "method: lora, or remove training.lora")
        return self

    def adapter(self) -> Lora | None:
        """LoRA's settings when the method is lora (the defaults when training.lora is absent), else None."""
        if self.method != "lora":
            return None
        return self.lora if self.lora is not None else Lora()


class Resources(ApiModel):
    """Where the job's ranks run: `nodes` pods (one per node), each with `ranks()` training processes; ZeRO-3
    partitions the model and its optimizer state across all nodes x ranks of them."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.ranksPerNode) || !has(self.gpus) || self.gpus == 0 || self.ranksPerNode == self.gpus",
            "ranksPerNode must equal gpus on GPU nodes (one rank per GPU)")]})

    gpus: int = Field(1, ge=0, le=64, description="GPUs per node; 0 trains on the CPU.")
    nodes: int = Field(1, ge=1, le=64, description="Nodes the job runs on, one pod each, placed all together or "
                                                   "not at all.")
    ranks_per_node: int | None = Field(
        None, ge=1, le=64, description="Training processes per node: one per GPU (the default, and the only choice "
                                       "with GPUs); on the CPU (gpus: 0) that many gloo ranks (default 1).")

    @model_validator(mode="after")
    def _one_rank_per_gpu(self) -> "Resources":
        if self.gpus and self.ranks_per_node is not None and self.ranks_per_node != self.gpus:
            raise ValueError(f"resources.ranksPerNode: {self.ranks_per_node} ranks cannot share {self.gpus} GPUs: "
                             "a node runs one rank per GPU (leave ranksPerNode out, or set it to gpus)")
        return self

    def ranks(self) -> int:
        """Training processes per node."""
        return self.gpus or self.ranks_per_node or 1

    def world_size(self) -> int:
        """Training processes of the whole job."""
        return self.nodes * self.ranks()


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
    output: Output | None = Field(None, description="Where the fine-tuned model is written.")
    checkpoint: Checkpoint | None = Field(None, description="Periodic checkpoints; a new attempt resumes from the "
                                                            "latest complete one.")
    volumes: list[Volume] = Field(
        [], max_length=MAX_VOLUMES, description="Volumes (Kubernetes' own types) holding the model, the data and "
                                                "the output.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    volume_mounts: list[VolumeMount] = Field(
        [], max_length=MAX_VOLUMES, description="Where the training container (and the model inspection pod, "
                                                "read-only) mounts them.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]})
    image: str = Field("ghcr.io/memstrata/runtime:0.1.0", min_length=1)
    command: list[str] | None = Field(None, min_length=1, description="Overrides the image's entrypoint.")
    run_policy: RunPolicy = RunPolicy()

    @model_validator(mode="after")
    def _fits_positions(self) -> "FineTuneJobSpec":
        shape = self.model.known_shape()
        names: set[str] = set()
        for i, v in enumerate(self.volumes):
            if v.name in names:
                raise ValueError(f"volumes[{i}].name: {v.name!r} is given twice")
            names.add(v.name)
        paths: set[str] = set()
        for i, m in enumerate(self.volume_mounts):
            if m.name not in names:
                raise ValueError(f"volumeMounts[{i}].name: {m.name!r} is not one of spec.volumes "
                                 f"({', '.join(sorted(names)) or 'none'})")
            if m.mount_path in paths:
                raise ValueError(f"volumeMounts[{i}].mountPath: {m.mount_path} is given twice")
            paths.add(m.mount_path)
        if (self.checkpoint is not None and self.output is not None
                and _under(self.checkpoint.path.rstrip("/"), self.output.path.rstrip("/"))):
            raise ValueError("checkpoint.path must not be output.path or inside it: the model directory is created "
                             "whole at the end")
        adapter = self.training.adapter()
        if shape is not None and adapter is not None:
            check_targets(adapter, shape)  # a model directory's own modules are checked again by the runtime
        if shape is not None and shape.spec.learned_positions \
                and self.training.sequence_length > shape.max_positions:
            raise ValueError(
                f"training.sequenceLength ({self.training.sequence_length}) exceeds the model's "
                f"{shape.max_positions} positions"
            )
        return self

    def with_architecture(self, architecture: ModelArchitecture) -> "FineTuneJobSpec":
        """This spec with model.architecture set (a shape read from the model directory), validated again:
        ValueError naming the field if the shape does not suit the rest of the spec."""
        if self.model.path is None:
            raise ValueError(f"model.preset {self.model.preset}: a preset has a fixed shape")
        model = {"path": self.model.path, "architecture": architecture.model_dump(mode="json", by_alias=True)}
        return FineTuneJobSpec.model_validate(
            {**self.model_dump(mode="json", by_alias=True, exclude_none=True), "model": model})


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
ConditionType = Literal["Inspected", "Created", "Scheduled", "Running", "Restarting", "Succeeded", "Failed",
                        "Suspended"]


# What a job's pod writes into its status (api.report.RUNTIME_STATUS_FIELDS) it writes with its own token, and a
# job may run its own code: so none of it is free text. Strings have a fixed form, maps fixed keys; what is left
# is numbers and the job's own paths.
DNS_NAME = r"^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
STRATA_KEYS: JsonDict = {"maxProperties": 4, "x-kubernetes-validations": [
    cel("self.all(k, k in ['hbm', 'dram', 'cxl', 'nvme'])", "strata are hbm, dram, cxl and nvme")]}


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
    validation_loss: float | None = Field(None, description="The latest validation loss.")
    learning_rate: float | None = None
    resumed_from: int | None = Field(None, description="The checkpoint step this attempt resumed from.")
    attempt: int | None = Field(None, ge=0, description="The pod attempt (0-based) that reported this progress: "
                                                        "what a previous attempt reported is not this one's.")
    tokens_per_second: float | None = None
    percent: int = Field(0, ge=0, le=100)
    eta_seconds: float | None = None
    # Written by the job's pod, whose token a job's own code holds: no free text (DNS_NAME, above).
    eta: str | None = Field(None, max_length=24, pattern=r"^[0-9]{1,12}(s|m[0-9]{2}s|h[0-9]{2}m)$",
                            description="The ETA for `kubectl get ftj`, e.g. 12m30s.")
    summary: str | None = Field(None, max_length=40, pattern=r"^[0-9]{1,15}/[0-9]{1,15} \([0-9]{1,3}%\)$",
                                description="step/total (percent), for `kubectl get ftj`.")


class FineTuneJobStatus(OperatorStatus):  # the operator's own bookkeeping fields: memstrata.api.jobstatus
    phase: Phase | None = None
    conditions: list[Condition] = []
    node: str | None = None
    nodes: list[str] | None = Field(None, description="A multi-node job's nodes by node rank, for the current "
                                                      "or last attempt (node is node rank 0's).")
    progress: Progress | None = None
    peak_memory: dict[str, int] | None = Field(
        None, description="Peak bytes per stratum, reported by the runtime: of the node of the job's rank 0, all its "
                          "ranks together (every node's: status.workers).", json_schema_extra=STRATA_KEYS)
    start_time: datetime | None = None
    completion_time: datetime | None = None
    restarts: int = 0
    message: str | None = None
    model_architecture: ModelArchitecture | None = Field(
        None, description="The shape read from the model directory (when spec.model.architecture is absent).")
    output: "OutputStatus | None" = None
    checkpoint: "CheckpointStatus | None" = Field(None, description="The latest complete checkpoint.")
    result: "ResultStatus | None" = Field(None, description="The final losses, once training has finished.")
    workers: "dict[str, WorkerStatus] | None" = Field(
        None, description="Per node of the job, keyed by its node rank (\"0\", \"1\", ...): each pod reports its "
                          "own entry, so one pod's report never overwrites another's.",
        json_schema_extra={"maxProperties": 64, "x-kubernetes-validations": [
            cel("self.all(k, k.matches('^[0-9]{1,2}$'))", "workers are keyed by node rank: 0, 1, ...")]})


class OutputStatus(ApiModel):
    """The fine-tuned model the runtime wrote."""

    path: str = Field(max_length=4096, pattern=r"^/")
    step: int = Field(ge=0, description="The optimizer step whose weights were saved.")
    files: int = Field(ge=0)
    bytes: int = Field(ge=0)
    validation_loss: float | None = None


class CheckpointStatus(ApiModel):
    """The latest complete checkpoint the runtime wrote."""

    path: str = Field(max_length=4096, pattern=r"^/.*/step-[0-9]{8,12}$")
    step: int = Field(ge=0)
    time: datetime
    bytes: int = Field(0, ge=0)
    seconds: float = Field(0, ge=0, description="How long writing it took.")


class WorkerStatus(ApiModel):
    """What one pod (one node of the job) reports about itself: its ranks fold into one entry."""

    pod: str = Field("", max_length=253, pattern=DNS_NAME)
    node: str | None = Field(None, max_length=253, pattern=DNS_NAME, description="The Kubernetes node the pod runs "
                                                                                  "on.")
    ranks: int = Field(1, ge=1, description="Training processes in this pod.")
    step: int = Field(0, ge=0)
    attempt: int | None = Field(None, ge=0)
    stage: Literal["initializing", "training", "finished", "failed"] | None = None
    tokens_per_second: float | None = Field(None, description="This node's ranks together.")
    peak_memory: dict[str, int] | None = Field(None, description="Peak bytes per stratum on this node (all its "
                                                                 "ranks).", json_schema_extra=STRATA_KEYS)


class ResultStatus(ApiModel):
    """The final numbers of a finished run."""

    steps: int = Field(ge=0)
    train_loss: float | None = Field(None, description="The mean loss of the last step.")
    validation_loss: float | None = None


FineTuneJob.model_rebuild()
