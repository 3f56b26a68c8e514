"""FineTuneJob's status: what the operator reports (phase, conditions, ...), what the job's pods report
(progress, output, checkpoint, workers, result), and the fields only the operator writes and reads back: its
memory between reconciles (OperatorStatus).

The operator's own fields are declared (FineTuneJobStatus inherits them), so the CRD's schema refuses a wrong type
at the API server. A value stored before the schema declared it can still come back wrong; `read_fields` says which
do not read as declared, so that the operator treats each as absent instead of acting on it
(memstrata.operator.bookkeeping).
"""
from __future__ import annotations

import re

from datetime import datetime
from typing import Any, Literal, Mapping

from pydantic import Field, ValidationError
from pydantic.json_schema import JsonDict

from memstrata.api import strata
from memstrata.api.architecture import ModelArchitecture
from memstrata.api.base import ApiModel, cel
from memstrata.api.validation import describe_validation_error
from memstrata.api.strataplan import Plan


class LastFailure(ApiModel):
    """The latest failed attempt: the retry's backoff counts from `time`, and its message says why."""

    pod: str
    reason: str | None = Field(None, description="How the pod ended: the kubelet's word (Error, OOMKilled, Evicted, "
                                                 "...) or the operator's (Deleted, Disappeared).")
    message: str
    time: datetime


class StatusShortfall(ApiModel):
    """Why no node can ever hold the job, per stratum (the job Failed as impossible)."""

    stratum: str
    missing_bytes: int = Field(ge=0)
    message: str


class OperatorStatus(ApiModel):
    # Integers strictly: a boolean or a numeric string in a counter is someone else's write, not the operator's.
    attempts: int | None = Field(None, ge=0, strict=True,
                                 description="Attempts made so far (pods are named by attempt).")
    active_pod: str | None = Field(None, description="The current attempt's pod (node rank 0's), written once it "
                                                     "exists.")
    failed_pods: list[str] | None = Field(None, description="Every failed attempt's pod, also once it is gone: "
                                                            "what spec.runPolicy.backoffLimit counts.")
    last_failure: LastFailure | None = None
    shortfalls: list[StatusShortfall] | None = None
    announced_checkpoint: int | None = Field(None, ge=0, strict=True,
                                             description="The checkpoint step last told in an event.")
    announced_resume: int | None = Field(None, ge=0, strict=True,
                                         description="The attempt whose resume was last told in an event.")
    workload: str | None = Field(None, max_length=253, description="The job's Kueue Workload, once made: the job stays "
                                 "queued through it even if its kueue.x-k8s.io/queue-name label is removed.")
    # Its fields keep the planner's snake_case names on the wire: the name every plan was written under.
    plan: Plan | None = Field(None, description="The plan of the current attempt, for its node rank 0's node "
                                                "(memstrata.plan); the missing pods of an attempt created in part "
                                                "are created with it.")


def read_fields(status: Mapping[str, Any]) -> tuple[OperatorStatus, dict[str, str]]:
    """Each operator field present in `status` that reads as its model declares it (the model's fields_set says
    which), and, in the dict, why each other one cannot be read, by its wire name, naming the field. Each is read
    alone: one bad field spoils no other."""
    values: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for name, info in OperatorStatus.model_fields.items():
        key = info.alias or name
        if status.get(key) is None:
            continue
        try:
            read = OperatorStatus.model_validate({key: status[key]})
        except ValidationError as exc:
            problems[key] = describe_validation_error(exc, "status")
            continue
        values[name] = getattr(read, name)
    # Each value was just validated as its field: constructing validates nothing twice.
    return OperatorStatus.model_construct(_fields_set=set(values), **values), problems


def wire_fields(own: OperatorStatus) -> dict[str, Any]:
    """The fields `read_fields` read, as status holds them (camelCase; a plan's own snake_case)."""
    out: dict[str, Any] = own.model_dump(mode="json", by_alias=True, exclude_none=True, include=own.model_fields_set)
    return out


# --- the job's status: what the operator and the job's pods report ------------------------------------

Phase = Literal["Pending", "Queued", "Created", "Scheduled", "Running", "Restarting", "Suspended", "Succeeded",
                "Failed"]
ConditionType = Literal["Inspected", "Queued", "Created", "Scheduled", "Running", "Restarting", "Succeeded", "Failed",
                        "Suspended"]


# What a job's pod writes into its status (api.report.RUNTIME_STATUS_FIELDS) it writes with its own token, and a
# job may run its own code: so none of it is free text. Strings have a fixed form, maps fixed keys; what is left
# is numbers and the job's own paths.
DNS_NAME = r"^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# An absolute path without blanks or markup, for the status fields a pod writes that name a directory.
STATUS_PATH = r"^/[-A-Za-z0-9._/+=@,:~]*$"


def status_path(path: str) -> str | None:
    """`path` as a pod may write it into the job's status, or None where it has characters STATUS_PATH refuses."""
    return path if len(path) <= 4096 and re.fullmatch(STATUS_PATH, path) else None


def strata_keys(schema: JsonDict) -> None:
    """The schema of a map keyed by stratum: the registry's strata (memstrata.api.strata), read when the schema is
    made, no other key."""
    known = strata.names()
    listed = ", ".join(f"'{n}'" for n in known)
    schema.update({"maxProperties": len(known), "x-kubernetes-validations": [
        cel(f"self.all(k, k in [{listed}])", f"strata are {', '.join(known[:-1])} and {known[-1]}")]})


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
    metrics_path: str | None = Field(None, max_length=4096, pattern=STATUS_PATH,
                                     description="Where the run's metrics.jsonl and TensorBoard event files are "
                                                 "(spec.output.metricsPath): `tensorboard --logdir` it.")


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
                                                                 "ranks).", json_schema_extra=strata_keys)


class ResultStatus(ApiModel):
    """The final numbers of a finished run."""

    steps: int = Field(ge=0)
    train_loss: float | None = Field(None, description="The mean loss of the last step.")
    validation_loss: float | None = None


class FineTuneJobStatus(OperatorStatus):  # the operator's own bookkeeping fields: above
    phase: Phase | None = None
    conditions: list[Condition] = []
    node: str | None = None
    nodes: list[str] | None = Field(None, description="A multi-node job's nodes by node rank, for the current "
                                                      "or last attempt (node is node rank 0's).")
    devices: list[str] | None = Field(
        None, description="The devices the current (or last) attempt's pod claimed through DRA, as pool/device "
                          "(the pool is the node's name), once the scheduler allocated them (nodeAgent.deviceApi dra).",
        json_schema_extra={"maxItems": 64, "items": {"type": "string", "maxLength": 253}})
    progress: Progress | None = None
    peak_memory: dict[str, int] | None = Field(
        None, description="Peak bytes per stratum, reported by the runtime: of the node of the job's rank 0, all its "
                          "ranks together (every node's: status.workers).", json_schema_extra=strata_keys)
    start_time: datetime | None = None
    completion_time: datetime | None = None
    restarts: int = 0
    message: str | None = None
    model_architecture: ModelArchitecture | None = Field(
        None, description="The shape read from the model directory (when spec.model.architecture is absent).")
    output: OutputStatus | None = None
    checkpoint: CheckpointStatus | None = Field(None, description="The latest complete checkpoint.")
    result: ResultStatus | None = Field(None, description="The final losses, once training has finished.")
    workers: dict[str, WorkerStatus] | None = Field(
        None, description="Per node of the job, keyed by its node rank (\"0\", \"1\", ...): each pod reports its "
                          "own entry, so one pod's report never overwrites another's.",
        json_schema_extra={"maxProperties": 64, "x-kubernetes-validations": [
            cel("self.all(k, k.matches('^[0-9]{1,2}$'))", "workers are keyed by node rank: 0, 1, ...")]})
