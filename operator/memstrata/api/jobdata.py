"""What a FineTuneJob reads and writes: its model, its dataset, its output and checkpoints, and the volumes
(Kubernetes' own types) that hold them, with where the operator's own volume and mounts are, which a user's
may not take."""
from __future__ import annotations

from typing import Annotated, Final

from pydantic import ConfigDict, Field, model_validator

from memstrata.api.architecture import PRESETS, ModelArchitecture, PresetName
from memstrata.api.base import ApiModel, cel
from memstrata.api.bounds import MAX_STEPS
from memstrata.api.units import Bytes, GiB


MAX_ADDED_TOKENS: Final = 1024
AddedToken = Annotated[str, Field(min_length=1, max_length=256)]


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
    added_tokens: list[AddedToken] | None = Field(
        None, min_length=1, max_length=MAX_ADDED_TOKENS,
        description="Tokens added to the tokenizer as special tokens (e.g. tool-call markers); the embedding (and "
                    "an untied LM head) grows by one row per token, new rows starting at the mean of the others "
                    "(the planner counts them); the output carries the grown model and tokenizer.",
        json_schema_extra={"x-kubernetes-list-type": "set"})

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.preset) != has(self.path)", "set exactly one of model.preset or model.path"),
                cel("!has(self.preset) || !has(self.architecture)",
                    "model.architecture is only for model.path; a preset has a fixed shape"),
                cel("!has(self.preset) || !has(self.addedTokens)",
                    "model.addedTokens: a preset trains with the byte tokenizer, which takes no tokens"),
            ]
        }
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if (self.preset is None) == (self.path is None):
            raise ValueError("set exactly one of model.preset or model.path")
        if self.preset is not None and self.added_tokens:
            raise ValueError("model.addedTokens: a preset trains with the byte tokenizer, which takes no tokens; "
                             "use model.path")
        twice = sorted({t for t in self.added_tokens or [] if (self.added_tokens or []).count(t) > 1})
        if twice:
            raise ValueError(f"model.addedTokens: {', '.join(map(repr, twice))} given twice")
        if self.preset is not None and self.architecture is not None:
            raise ValueError("model.architecture is only for model.path; a preset has a fixed shape")
        return self

    def trained_shape(self, shape: ModelArchitecture | None = None) -> ModelArchitecture:
        """The shape that trains: `shape` (default `shape()`; the runtime passes the model directory's) with a row
        of the vocabulary per added token."""
        shape = shape if shape is not None else self.shape()
        return shape.model_copy(update={"vocab": shape.vocab + len(self.added_tokens or [])})

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


DEFAULT_SHARD: Final = 2 * GiB


class Output(ApiModel):
    """Where the fine-tuned model goes: a Hugging Face directory, written atomically at the end (with
    training.method lora: the adapter in PEFT format, and the merged model in `merged/` with lora.mergeOnSave)."""

    path: str = Field(min_length=1, description="A directory that must not exist yet, on a writable volume.")
    shard_size: Bytes = Field(DEFAULT_SHARD, description="Largest safetensors shard (default 2Gi).")
    metrics_path: str | None = Field(
        None, min_length=1, description="Directory for metrics.jsonl (one line per step) and TensorBoard event "
                                        "files; default: `<path>-metrics` beside the model.")

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.metricsPath) || !(self.metricsPath == self.path || self.metricsPath.startsWith(self.path + '/'))",
        "output.metricsPath must not be output.path or inside it: the model directory is created whole at the end",
        ".metricsPath")]})

    @model_validator(mode="after")
    def _metrics_outside_model(self) -> "Output":
        if self.metrics_path is not None and under(self.metrics_path.rstrip("/"), self.path.rstrip("/")):
            raise ValueError("output.metricsPath must not be output.path or inside it: the model directory is "
                             "created whole at the end")
        return self

    def metrics_dir(self) -> str:
        return self.metrics_path or f"{self.path.rstrip('/')}-metrics"


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
    export_model: bool = Field(False, description="Also write each checkpoint's model in Hugging Face format to "
                                                  "`model/` in its step directory (what output.path would get), "
                                                  "which transformers or PEFT loads while the run goes on.")

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


def under(path: str, root: str) -> bool:
    """Whether `path` is `root` or inside it (`root` without a trailing slash)."""
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
            if under(self.mount_path, root):
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
