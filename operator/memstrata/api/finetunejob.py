"""FineTuneJob (memstrata.dev/v1alpha1): what a user applies — how to train, on what resources, with what
memory policy. The model, data, output and volumes it names are memstrata.api.jobdata's; the status the
operator and the job's pods report, memstrata.api.jobstatus's.

The CRD in crds/ is generated from these models (`memstrata crd`); cross-field
rules are written twice on purpose — as pydantic validators for the CLI and as
CEL `x-kubernetes-validations` for the API server — and tests hold them together.
"""
from __future__ import annotations

import math
from typing import Final, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.base import ApiModel, cel
from memstrata.api.bounds import MAX_BATCH, MAX_SEED, MAX_STEPS
from memstrata.api.dataset import Dataset
from memstrata.api.jobdata import MAX_VOLUMES, Checkpoint, ModelSource, Output, Volume, VolumeMount, under
from memstrata.api.jobstatus import FineTuneJobStatus
from memstrata.api.layermajor import layer_major_refusal
from memstrata.api.updatemode import UpdateMode, update_refusal
from memstrata.api.lora import Lora, check_targets
from memstrata.api.selection import EarlyStopping, selection_problem
from memstrata.api.strataplan import Engine
from memstrata.api.units import Bytes

GROUP = "memstrata.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "memstrata.dev/v1alpha1"  # GROUP/VERSION, spelt out so its type is the Literal
KIND: Final = "FineTuneJob"
PLURAL = "finetunejobs"
SINGULAR = "finetunejob"
SHORT_NAMES = ["ftj"]

Precision = Literal["bf16", "fp16", "fp32"]
Method = Literal["full", "lora"]
ScheduleType = Literal["constant", "linear", "cosine"]


class LearningRateSchedule(ApiModel):
    """Linear warmup from 0 to training.learningRate, then constant, linear or cosine decay to
    `minLearningRateRatio` x learningRate at the last step (Hugging Face's schedules, with a floor)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.warmupSteps) || !has(self.warmupRatio) || self.warmupSteps == 0 || self.warmupRatio == 0.0",
        "schedule: set warmupSteps or warmupRatio, not both")]})

    type: ScheduleType = "constant"
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Optimizer steps of linear warmup.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Warmup as a fraction of training.steps, rounded up "
                                                             "(transformers' warmup_ratio); instead of warmupSteps.")
    min_learning_rate_ratio: float = Field(0.0, ge=0, le=1, description="The decay's floor, as a fraction of "
                                                                        "learningRate (linear and cosine).")

    @model_validator(mode="after")
    def _one_warmup(self) -> "LearningRateSchedule":
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(f"schedule: set warmupSteps or warmupRatio, not both (warmupSteps {self.warmup_steps}, "
                             f"warmupRatio {self.warmup_ratio:g})")
        return self

    def warmup(self, total_steps: int) -> int:
        """Optimizer steps of warmup in a run of `total_steps`: warmupSteps, or warmupRatio x the steps rounded up
        (as transformers' get_warmup_steps rounds it)."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * total_steps)


class Optimizer(ApiModel):
    """AdamW (DeepSpeed's CPU Adam when the optimizer state is offloaded)."""

    type: Literal["adamw"] = "adamw"
    beta1: float = Field(0.9, ge=0, lt=1, description="Decay of the first moment.")
    beta2: float = Field(0.95, ge=0, lt=1, description="Decay of the second moment.")
    eps: float = Field(1e-8, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=10, description="Decoupled weight decay (AdamW), of the weight "
                                                               "matrices and embeddings: biases and norm scales "
                                                               "are not decayed.")


class Training(ApiModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.schedule) || !has(self.schedule.warmupSteps) || has(self.epochs) || "
            "self.schedule.warmupSteps <= self.steps", "schedule.warmupSteps must not exceed training.steps"),
        cel("(has(self.steps) && self.steps > 0) != has(self.epochs)", "set exactly one of training.steps or "
            "training.epochs", ".steps"),
        cel("!has(self.lora) || (has(self.method) && self.method == 'lora')",
            "training.lora is only for training.method: lora", ".lora")]})

    method: Method = Field("full", description="full: every parameter trains; lora: low-rank adapters train and "
                                               "the base weights stay frozen (settings in `lora`).")
    lora: Lora | None = Field(None, description="LoRA's settings, for method: lora (defaults when absent).")
    sequence_length: int = Field(2048, gt=0, le=1 << 20)
    micro_batch: int = Field(1, gt=0, le=MAX_BATCH)
    gradient_accumulation: int = Field(1, gt=0, le=MAX_BATCH)
    epochs: float | None = Field(None, gt=0, le=10_000, description="Passes over the training data instead of steps: "
                                                                    "the runtime counts the sequences of one pass "
                                                                    "(packed as trained) and runs as many steps as "
                                                                    "that many passes take, rounded up.")
    steps: int = Field(0, ge=0, le=MAX_STEPS, description="Optimizer steps (or set epochs instead).")
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
    eval_sample_prompt: str | None = Field(
        None, min_length=1, max_length=4096, description="At every evaluation, the model's greedy answer to this "
                                                         "prompt (through the chat template when the tokenizer has "
                                                         "one) goes to metrics.jsonl, TensorBoard and the log.")
    eval_sample_tokens: int = Field(32, gt=0, le=1024, description="The most tokens of that answer.")
    layer_major: bool | None = Field(
        None, description="Every micro-batch of a step through a layer before the next layer, so each weight is "
                          "gathered (read from NVMe) once a forward and once a backward per step, not per "
                          "micro-batch; it keeps gradientAccumulation x the activation checkpoints. Unset: on "
                          "where the plan puts weights on NVMe; needs gradientAccumulation > 1, "
                          "activationCheckpointing, lossChunkTokens > 0 and memory.engine memstrata.")
    update: UpdateMode = Field(
        "exact", description="exact: each step's gradient is taken at the weights the update before it left "
                             "(ZeRO-3's numerics). delayed (by name; ZeRO-Offload's delayed parameter update): each "
                             "update runs beside the next step's forward and backward, which is taken at the "
                             "weights from before it (one step stale), hiding the update's I/O behind a whole step; "
                             "needs memory.engine memstrata, and the plan counts 2 bytes per trained parameter more "
                             "with the weights.")
    schedule: LearningRateSchedule = LearningRateSchedule()
    optimizer: Optimizer = Optimizer()
    gradient_clipping: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: no "
                                                            "clipping).")
    keep_best: bool = Field(False, description="The output is the model of the evaluation with the lowest "
                                               "validation loss (needs evalInterval and validation data), not the "
                                               "last step's.")
    early_stopping: EarlyStopping | None = Field(None, description="Stop when the validation loss stops falling.")
    neftune_noise_alpha: float | None = Field(
        None, gt=0, le=100, description="NEFTune: uniform noise of magnitude alpha / sqrt(sequence x hidden) added to "
                                        "the input embeddings while training (5 in the paper; transformers' "
                                        "neftune_noise_alpha); validation and the saved model see none.")

    @field_validator("steps")
    @classmethod
    def _steps_or_epochs(cls, steps: int, info: ValidationInfo) -> int:
        # Here, not on the model, so the error names spec.training.steps (epochs is validated first).
        epochs = info.data.get("epochs")
        if (steps > 0) == (epochs is not None):
            raise ValueError("set exactly one of training.steps or training.epochs"
                             + (f" (steps {steps}, epochs {epochs:g})" if steps else ""))
        return steps

    @model_validator(mode="after")
    def _warmup_fits(self) -> "Training":
        if self.epochs is None and self.schedule.warmup_steps > self.steps:
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


ADDED_TOKENS_LORA = ("model.addedTokens with training.method lora: the new tokens' embedding rows would stay as "
                     "they start (LoRA freezes the embedding); use training.method full")
# The spec-level CEL rules these validators mirror are in memstrata.api.crd.spec_rules (their one home).
ADDED_TOKENS_LORA_RULE = cel("!has(self.model.addedTokens) || !has(self.training.method) || "
                             "self.training.method != 'lora'", ADDED_TOKENS_LORA)


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
                and under(self.checkpoint.path.rstrip("/"), self.output.path.rstrip("/"))):
            raise ValueError("checkpoint.path must not be output.path or inside it: the model directory is created "
                             "whole at the end")
        selection = selection_problem(self.training, self.dataset)
        if selection is not None:
            raise ValueError(selection)
        t = self.training
        refusal = layer_major_refusal(engine=self.memory.engine, gradient_accumulation=t.gradient_accumulation,
                                      activation_checkpointing=t.activation_checkpointing,
                                      loss_chunk_tokens=t.loss_chunk_tokens) if t.layer_major else None
        if refusal is not None:
            raise ValueError(f"training.layerMajor: {refusal}")
        refusal = update_refusal(update=t.update, engine=self.memory.engine)
        if refusal is not None:
            raise ValueError(f"training.update: {refusal}")
        if self.model.added_tokens and self.training.method == "lora":
            raise ValueError(ADDED_TOKENS_LORA)
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
        model = {**self.model.model_dump(mode="json", by_alias=True, exclude_none=True),
                 "architecture": architecture.model_dump(mode="json", by_alias=True)}
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
    status: FineTuneJobStatus | None = None
