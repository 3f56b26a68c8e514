"""The on-disk checkpoint contract: one directory per optimizer step, its manifest and what must match to resume.

A checkpoint is `<spec.checkpoint.path>/step-NNNNNNNN/`, holding per rank one
safetensors file per optimizer sub-group (fp32 master weights and optimizer
moments), the rank's RNG and optimizer scalars (`rank-RRRRR.json`): every
rank writes its own files, named by its rank, into the one directory; the
manifest (`checkpoint.json`: what was trained, where the data stood, the LR
schedule, a size and sha256 per file) and, written last, the marker
(`COMPLETE`, holding the manifest's sha256). The directory is written under a
hidden partial name and renamed into place once complete, so a directory that
is named `step-*` and has a marker whose hash matches is complete; anything
else is an interrupted write.

Pure: names, the manifest model and the resume rule; the runtime does the I/O.
"""
from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Final

from pydantic import Field

from memstrata.api.base import ApiModel

FORMAT: Final = 1
MANIFEST: Final = "checkpoint.json"
MARKER: Final = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_RANKED = re.compile(r"^rank-(\d{5,})[-.]")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a complete checkpoint's directory name, or None for anything else (a partial, a stray file)."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def group_file(rank: int, group: int) -> str:
    return f"rank-{rank:05d}-group-{group:05d}.safetensors"


def file_rank(name: str) -> int | None:
    """The rank that wrote a checkpoint file (None: the manifest, the marker, anything not a rank's)."""
    m = _RANKED.match(name)
    return int(m.group(1)) if m else None


class FileDigest(ApiModel):
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Identity(ApiModel):
    """What a checkpoint must share with the run that resumes from it."""

    memstrata_version: str
    model: dict[str, Any] = Field(description="The model architecture (memstrata.api.architecture), as trained.")
    precision: str
    world_size: int = Field(ge=1)
    sub_groups: list[int] = Field(description="Elements per optimizer sub-group of rank 0 (the ZeRO-3 layout).")
    rank_sub_groups: list[list[int]] = Field(default_factory=list, description=(
        "Elements per optimizer sub-group of every rank, by rank (empty before the engine exists, and in "
        "checkpoints of one rank written before ranks were recorded: sub_groups is then the only layout)."))
    job_uid: str = Field("", description="The FineTuneJob's uid; empty for a local run.")
    job: str = Field("", description="The FineTuneJob's name.")
    training: dict[str, Any] = Field(default_factory=dict, description="What decides which data a step sees, "
                                                                       "how it is batched and what trains (not the "
                                                                       "step count): run_fingerprint.")


class SelectionState(ApiModel):
    """Where the choice of the best model stood at a checkpoint (memstrata.runtime.train.best), so that a resumed
    run stops early exactly where an uninterrupted one would."""

    best_step: int | None = Field(None, ge=1, description="The step of the lowest validation loss so far.")
    best_loss: float | None = None
    waiting: int = Field(0, ge=0, description="Evaluations since that best (earlyStopping.patience counts them).")


class Manifest(ApiModel):
    format: int = FORMAT
    identity: Identity
    job: str
    step: int = Field(ge=1, description="Optimizer steps taken: training resumes at step + 1.")
    time: datetime
    engine: str
    micro_batches: int = Field(ge=0, description="Training micro-batches consumed (the data position).")
    scheduler: dict[str, Any] | None = Field(None, description="The LR scheduler's state_dict.")
    counters: dict[str, int] = Field(default_factory=dict, description="DeepSpeed engine counters.")
    loss: float | None = Field(None, description="The training loss of the step.")
    validation_loss: float | None = None
    selection: SelectionState | None = Field(None, description="The best model's choice at this step; absent in "
                                                               "checkpoints written before it was recorded.")
    files: dict[str, FileDigest]

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


# What a checkpoint written before these fingerprint keys existed was trained with: a full fine-tune.
FINGERPRINT_DEFAULTS: Final[dict[str, Any]] = {"training.method": "full", "training.lora": None,
                                               "dataset.completionOnlyLoss": True}


def identity_mismatches(saved: Identity, current: Identity) -> list[str]:
    """Why a checkpoint with `saved` cannot resume a run with `current`, one line per difference (empty: it can).

    The optimizer state is partitioned by rank and sub-group; memstrata does not reshard it, so another world
    size or layout is refused, as are another model, precision, memstrata version and another job."""
    out: list[str] = []
    if saved.memstrata_version != current.memstrata_version:
        out.append(f"memstrata version: the checkpoint was written by {saved.memstrata_version}, this runtime is "
                   f"{current.memstrata_version}")
    for key in sorted(set(saved.model) | set(current.model)):
        if saved.model.get(key) != current.model.get(key):
            out.append(f"model.{key}: the checkpoint has {saved.model.get(key)!r}, this job {current.model.get(key)!r}")
    if saved.precision != current.precision:
        out.append(f"training.precision: the checkpoint has {saved.precision}, this job {current.precision}")
    if saved.world_size != current.world_size:
        out.append(f"world size: the checkpoint was written by {saved.world_size} ranks, this run has "
                   f"{current.world_size} (memstrata does not reshard optimizer state)")
    elif current.sub_groups and (saved.sub_groups != current.sub_groups or (  # empty: not known yet
            saved.rank_sub_groups and current.rank_sub_groups and saved.rank_sub_groups != current.rank_sub_groups)):
        def layout(i: Identity) -> str:
            groups = i.rank_sub_groups or [i.sub_groups]
            return f"{sum(map(len, groups))} ({sum(map(sum, groups))} elements)"

        out.append(f"optimizer sub-groups: the checkpoint has {layout(saved)}, this run {layout(current)}")
    if saved.job_uid and current.job_uid and saved.job_uid != current.job_uid:
        out.append(f"job: the checkpoint belongs to another FineTuneJob (uid {saved.job_uid}, this one is "
                   f"{current.job_uid})")
    elif saved.job and current.job and saved.job != current.job:
        out.append(f"job: the checkpoint belongs to job {saved.job!r}, this one is {current.job!r}")
    for key in sorted(set(saved.training) | set(current.training)):
        was = saved.training.get(key, FINGERPRINT_DEFAULTS.get(key))
        if was != current.training.get(key):
            why = ("another set of parameters would train, with other optimizer state"
                   if key in ("training.method", "training.lora") else "the data position and schedule would not carry over")
            out.append(f"{key}: the checkpoint has {was!r}, this job {current.training.get(key)!r} ({why})")
    return out


def run_fingerprint(training: Any, dataset: Any) -> dict[str, Any]:
    """The settings a resumed run must share with the one that saved: batching, sequence, seed, data, schedule
    and rate, and what trains - the method and LoRA's adapter shape (a FineTuneJob's spec.training and
    spec.dataset). `steps` may change: it is how a run is extended; so may lora.mergeOnSave, which only decides
    what is written at the end."""
    t = training.model_dump(mode="json", by_alias=True)
    keep = ("sequenceLength", "microBatch", "gradientAccumulation", "seed", "learningRate", "schedule", "method")
    adapter = training.adapter()
    # useRslora, useDora and modulesToSave only when set, so an adapter's fingerprint from before the fields existed
    # still matches.
    lora = adapter.model_dump(mode="json", by_alias=True, exclude={"merge_on_save"} | {
        f for f in ("use_rslora", "use_dora", "modules_to_save") if not getattr(adapter, f)}) if adapter is not None \
        else None
    return {**{f"training.{k}": t[k] for k in keep if k in t}, "training.lora": lora,
            **{f"dataset.{k}": v for k, v in dataset.model_dump(mode="json", by_alias=True).items()}}
