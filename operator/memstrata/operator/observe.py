"""The operator's read of a FineTuneJob and its pods. Pure: API dicts in, frozen views out.

The lifecycle decides only from these views, so every decision can be tested
with plain dicts shaped like what the API server returns.

A container's termination message is the one thing in a pod's status that the container itself wrote, and
the container may run a job's own code. The operator puts it into the job's status (lastFailure, the Failed
condition, events), which whoever may read the job reads: so it is read here once, through container_text
(bounded, printable, credentials redacted), and a failure's reason in status is one of FAILURE_REASONS.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping

from pydantic import ValidationError

from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.validation import describe_validation_error
from memstrata.api.strataplan import Plan
from memstrata.operator.bookkeeping import read as read_bookkeeping
from memstrata.operator.names import LABEL_ATTEMPT, LABEL_NODE_RANK, LABEL_ROLE, ROLE_INSPECT

TERMINAL = ("Succeeded", "Failed")
# A failure's reason in status.lastFailure: the kubelet's own words for how a pod ended, and the operator's.
FAILURE_REASONS = ("Error", "OOMKilled", "ContainerCannotRun", "StartError", "DeadlineExceeded", "Evicted",
                   "Preempted", "NodeLost", "Shutdown", "Terminated", "UnexpectedAdmissionError", "Deleted",
                   "Disappeared", "Failed")
MESSAGE_CHARS = 512  # of a container's termination message in the job's status (the kubelet keeps 4 KiB)
REDACTED = "[redacted]"
_CREDENTIALS = re.compile(
    r"-----BEGIN [A-Z0-9 ]+-----.*?(?:-----END [A-Z0-9 ]+-----|$)"  # a PEM key or certificate
    r"|eyJ[\w-]+\.[\w-]+\.[\w-]*"  # a JWT, as a ServiceAccount token is
    r"|[A-Za-z0-9+=_-]{40,}",  # a long unbroken run: a key, a token, a hash, base64
    re.DOTALL)


def container_text(raw: str) -> str:
    """A container's termination message as the job's status may carry it: credentials redacted, printable
    ASCII on one line, at most MESSAGE_CHARS characters."""
    text = "".join(c if c.isascii() and c.isprintable() else " " for c in _CREDENTIALS.sub(REDACTED, raw))
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3] + "..."


def failure_reason(reason: str) -> str:
    """`reason` if it is one of FAILURE_REASONS, else "Failed"."""
    return reason if reason in FAILURE_REASONS else "Failed"


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class JobView:
    name: str
    namespace: str
    uid: str
    labels: Mapping[str, str]
    spec: FineTuneJobSpec | None
    spec_error: str  # why spec could not be read (the CRD and the models disagree)
    status: Mapping[str, Any]  # the operator's own fields that do not read taken out (memstrata.operator.bookkeeping)
    deleting: bool
    created: datetime | None
    finalizers: tuple[str, ...] = ()
    resource_version: str = ""
    malformed: Mapping[str, str] = field(default_factory=dict)  # per field taken out of status, why
    plan: Plan | None = None  # status.plan as read: the current attempt's


def job_view(body: Mapping[str, Any]) -> JobView:
    meta = body.get("metadata") or {}
    try:
        spec: FineTuneJobSpec | None = FineTuneJobSpec.model_validate(body.get("spec") or {})
        error = ""
    except ValidationError as exc:
        spec, error = None, describe_validation_error(exc, "spec")
    status, malformed, plan = read_bookkeeping(meta.get("name", ""), body.get("status") or {})
    return JobView(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        labels=dict(meta.get("labels") or {}),
        spec=spec,
        spec_error=error,
        status=status,
        deleting=bool(meta.get("deletionTimestamp")),
        created=parse_time(meta.get("creationTimestamp")),
        finalizers=tuple(meta.get("finalizers") or ()),
        resource_version=str(meta.get("resourceVersion") or ""),
        malformed=malformed,
        plan=plan,
    )


@dataclass(frozen=True)
class PodView:
    name: str
    attempt: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    node: str | None
    deleting: bool
    exit_code: int | None = None
    reason: str = ""  # why it terminated or why it cannot be scheduled
    unschedulable: bool = False
    finished_at: datetime | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    message: str = ""  # the terminated container's termination message, through container_text
    ended: str = ""  # how it ended, in the kubelet's words (terminated.reason, or the pod's status.reason)
    inspection: bool = False  # the model inspection pod, not a training attempt
    node_rank: int = 0  # which node of a multi-node job (0 for a single-node job's pod)
    devices: tuple[str, ...] = ()  # what its DRA claim was allocated, as pool/device (the reconciler reads it)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    @property
    def active(self) -> bool:
        """Holding (or about to hold) the job's place on a node."""
        return not self.terminal and not self.deleting

    @property
    def failure_reason(self) -> str:
        """Why it failed, one of FAILURE_REASONS."""
        return "Deleted" if self.deleting and not self.terminal else failure_reason(self.ended)

    def describe_failure(self) -> str:
        bits = [f"pod {self.name}"]
        if self.deleting and not self.terminal:
            bits.append("was deleted before it finished")
        else:
            bits.append("failed")
            if self.exit_code is not None:
                bits.append(f"with exit code {self.exit_code}")
        if self.reason:
            bits.append(f"({self.reason})")
        return " ".join(bits)

    def describe_gang_failure(self) -> str:
        """describe_failure for a pod of a multi-node job: which node rank and node, since one pod's end
        ends its whole attempt."""
        where = f" on node {self.node}" if self.node else ""
        return f"{self.describe_failure()} (node rank {self.node_rank}{where}); the attempt's other pods are stopped"


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The ResourceClaims the kubelet's controller made for a pod (status.resourceClaimStatuses)."""
    return [s["resourceClaimName"] for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
            if s.get("resourceClaimName")]


def allocated_devices(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """A ResourceClaim's allocated devices as pool/device, in the allocation's order; () before allocation."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return tuple(f"{r.get('pool')}/{r.get('device')}" for r in results)


def pod_view(pod: Mapping[str, Any], devices: tuple[str, ...] = ()) -> PodView:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    labels = dict(meta.get("labels") or {})
    try:
        attempt = int(labels.get(LABEL_ATTEMPT, "0"))
    except ValueError:
        attempt = 0
    try:
        node_rank = int(labels.get(LABEL_NODE_RANK, "0"))
    except ValueError:
        node_rank = 0
    exit_code, reason, finished, message = None, status.get("reason") or "", None, ""
    ended = reason
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if term:
            exit_code = term.get("exitCode")
            reason = ended = term.get("reason") or reason
            if term.get("message"):
                message = container_text(str(term["message"]))
                reason = f"{reason}: {message}" if reason else message
            finished = parse_time(term.get("finishedAt"))
            if exit_code:
                break  # the failing container explains the pod
    unschedulable = False
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            unschedulable = cond.get("reason") == "Unschedulable"
            if status.get("phase", "Pending") == "Pending":
                reason = cond.get("message") or cond.get("reason") or reason
    return PodView(
        name=meta.get("name", ""),
        attempt=attempt,
        phase=status.get("phase") or "Pending",
        node=spec.get("nodeName"),
        deleting=bool(meta.get("deletionTimestamp")),
        exit_code=exit_code,
        reason=reason,
        unschedulable=unschedulable,
        finished_at=finished,
        labels=labels,
        message=message,
        ended=ended,
        inspection=labels.get(LABEL_ROLE) == ROLE_INSPECT,
        node_rank=node_rank,
        devices=devices,
    )
