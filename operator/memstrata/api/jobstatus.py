"""The FineTuneJob status fields only the operator writes and reads back: its memory between reconciles.

Declared (FineTuneJobStatus inherits them), so the CRD's schema refuses a wrong type at the API server. A value
stored before the schema declared it can still come back wrong; `read_fields` says which do not read as declared,
so that the operator treats each as absent instead of acting on it (memstrata.operator.bookkeeping).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from pydantic import Field, ValidationError

from memstrata.api.base import ApiModel
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
