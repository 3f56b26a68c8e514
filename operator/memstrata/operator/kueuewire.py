"""A Kueue Workload as the API holds it (memstrata.operator.kueue decides with it). Pure.

What the operator reads of the job's Workload (Workload, workload_view), the Workload it creates (workload_body),
which nodes an admission allows (allows), and the writes it makes to it: clearing an evicted Workload's admission,
Finished, PodsReady, each as Kueue's own job integrations write them (its jobframework), and each a compare-and-swap
on the version read; and deactivating one for its job's suspension.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.operator import names
from memstrata.operator.actions import Action, WorkloadWrite
from memstrata.operator.conditions import with_condition
from memstrata.operator.nodes import quantity
from memstrata.operator.observe import JobView, PodView
from memstrata.operator.render import TOLERATIONS, child_meta

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
PLURAL = "workloads"
QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_LABEL = f"{GROUP}/priority-class"
PODSET = "workers"
# On a Workload the operator deactivated because its job was suspended: only such a Workload is reactivated when the
# job is unsuspended. One Kueue deactivated (requeuing limit, maximum execution time, a rejected check) stays so.
SUSPENDED = "memstrata.dev/deactivated-for-suspend"
# Kueue's eviction reasons after which it puts the Workload back in its queue by itself (Requeued=True).
REQUEUED_BY_KUEUE = ("Preempted", "NodeFailures")


def queue_of(job: JobView) -> str | None:
    """The LocalQueue the job asks for; None when it asks for none."""
    return job.labels.get(QUEUE_LABEL) or None


def is_queued(job: JobView) -> bool:
    """Whether the job is queued through Kueue: it asks for a queue, or it has a Workload already (a label removed
    later would otherwise let a job run past its quota)."""
    return bool(queue_of(job) or job.status.get("workload"))


@dataclass(frozen=True)
class Workload:
    """What the operator reads of the job's Workload."""

    name: str
    resource_version: str
    conditions: Mapping[str, Mapping[str, Any]]  # by type
    admission: Mapping[str, Any] | None
    active: bool = True
    queue: str = ""
    suspended: bool = False  # deactivated by the operator for its job's suspension (SUSPENDED)
    requests: Mapping[str, int] = field(default_factory=dict)  # each pod's, as the podSet states them

    def true(self, type_: str) -> Mapping[str, Any] | None:
        cond = self.conditions.get(type_)
        return cond if cond is not None and cond.get("status") == "True" else None

    @property
    def admitted(self) -> bool:
        return self.admission is not None and self.true("Admitted") is not None

    @property
    def evicted(self) -> Mapping[str, Any] | None:
        return self.true("Evicted")

    @property
    def finished(self) -> bool:
        return self.true("Finished") is not None

    @property
    def cluster_queue(self) -> str:
        return str((self.admission or {}).get("clusterQueue") or "")

    @property
    def flavors(self) -> tuple[str, ...]:
        found = {str(f) for a in (self.admission or {}).get("podSetAssignments") or []
                 for f in (a.get("flavors") or {}).values()}
        return tuple(sorted(found))

    def waiting(self) -> tuple[str, str]:
        """Why Kueue has not admitted it, in Kueue's words: (reason, message)."""
        for type_ in ("QuotaReserved", "Admitted"):
            cond = self.conditions.get(type_)
            if cond is not None and cond.get("status") == "False" and cond.get("message"):
                return str(cond.get("reason") or "Pending"), str(cond["message"])
        if not self.active:
            return "Inactive", f"Workload {self.name} is deactivated (spec.active is false)"
        return "Pending", f"Workload {self.name} waits for Kueue to consider it"


def workload_view(body: Mapping[str, Any]) -> Workload:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    podsets = spec.get("podSets") or [{}]
    container = ((podsets[0].get("template") or {}).get("spec") or {}).get("containers") or [{}]
    requests = (container[0].get("resources") or {}).get("requests") or {}
    return Workload(
        name=str(meta.get("name") or ""), resource_version=str(meta.get("resourceVersion") or ""),
        conditions={str(c.get("type")): c for c in status.get("conditions") or []},
        admission=status.get("admission"), active=spec.get("active", True) is not False,
        queue=str(spec.get("queueName") or ""), suspended=SUSPENDED in (meta.get("annotations") or {}),
        requests={str(k): _quantity(v) for k, v in requests.items()})


def _quantity(value: Any) -> int:
    """A podSet's request, as a node's allocatable is read (nodes.quantity: Kubernetes' Quantity.Value())."""
    try:
        return quantity(value)
    except ValueError:
        return -1  # not a quantity: no node fits it, so nothing is placed against it


def workload_body(job: JobView, spec: FineTuneJobSpec, requests: Mapping[str, int],
                  priority: tuple[str, int] | None) -> dict[str, Any]:
    """The job's Workload: `requests` each pod's (render.container_requests); `priority`: the
    WorkloadPriorityClass named by the job's label and its value."""
    quantities = {r: str(n) for r, n in sorted(requests.items())}
    container = {"name": names.CONTAINER, "image": spec.image,
                 "resources": {"requests": quantities, "limits": quantities}}
    body: dict[str, Any] = {
        "apiVersion": API_VERSION, "kind": "Workload",
        "metadata": child_meta(job, names.workload_name(job.name, job.uid)),  # owned by the job: deleted with it
        "spec": {
            "queueName": queue_of(job),
            "active": not spec.run_policy.suspend,
            "podSets": [{"name": PODSET, "count": spec.resources.nodes,
                         "template": {"spec": {"restartPolicy": "Never", "containers": [container],
                                               # Kueue matches flavors with nodeTaints against them
                                               "tolerations": [dict(t) for t in TOLERATIONS]}}}]},
    }
    if priority is not None:
        body["spec"]["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority[0]}
        body["spec"]["priority"] = priority[1]
    return body


def allows(workload: Workload, node_labels: Mapping[str, str], labels: Mapping[str, str],
           requests: Mapping[str, int]) -> bool:
    """Whether an admitted job may be placed on a node with `labels` where its plan asks `requests` of each pod:
    the node carries every label of the admitted flavors (`node_labels`, merged), and the plan asks no more of any
    resource than was admitted. A node where the plan needs more would run the job over its quota."""
    if any(labels.get(k) != v for k, v in node_labels.items()):
        return False
    return all(n <= workload.requests.get(r, 0) for r, n in requests.items() if n)


# -- status writes on the Workload (each a compare-and-swap on the version read) ------------------------------------

def _with(workload: Workload, now: str, *conds: tuple[str, str, str, str]) -> list[dict[str, Any]]:
    """The Workload's conditions with `conds` set (a condition's message is at most 32768 characters)."""
    out = [dict(c) for c in workload.conditions.values()]
    for type_, status, reason, message in conds:
        out = with_condition(out, type_, status, reason, message[:32768], now)
    return out


def release(workload: Workload, now: str) -> WorkloadWrite:
    """Clear an evicted Workload's admission once the job's pods are gone: Kueue then queues it again (what
    Kueue's own integrations write, jobframework's UnsetQuotaReservationWithCondition)."""
    evicted = workload.evicted or {}
    reason, message = str(evicted.get("reason") or "Evicted"), str(evicted.get("message") or "evicted")
    conditions = _with(workload, now,
                       ("QuotaReserved", "False", "Pending", message),
                       ("Admitted", "False", "NoReservation", "The workload has no reservation"),
                       ("Requeued", "True" if reason in REQUEUED_BY_KUEUE else "False", reason, message),
                       *([("PodsReady", "False", "WaitForStart", NOT_READY)] if "PodsReady" in workload.conditions
                         else []))
    return WorkloadWrite(workload.name, "status", {"metadata": {"resourceVersion": workload.resource_version},
                                                   "status": {"admission": None, "conditions": conditions}})


def finish(workload: Workload, phase: str, message: str, now: str) -> WorkloadWrite:
    """The job ended: Finished, so Kueue releases its quota."""
    conditions = _with(workload, now, ("Finished", "True", phase, message))
    return WorkloadWrite(workload.name, "status", {"metadata": {"resourceVersion": workload.resource_version},
                                                   "status": {"conditions": conditions}})


NOT_READY = "Not all pods are ready or succeeded"


def pods_ready(workload: Workload, pods: Sequence[PodView], nodes: int, now: str) -> list[Action]:
    """The admitted Workload's PodsReady condition, which Kueue's waitForPodsReady waits on (it evicts a Workload
    whose pods do not all run in time), written as Kueue's own integrations write it (generatePodsReadyCondition):
    True once every pod of the attempt runs or has succeeded; False after that, waiting for recovery."""
    ready = sum(1 for p in pods if (p.active and p.phase == "Running") or p.phase == "Succeeded") >= nodes
    old = workload.conditions.get("PodsReady")
    if ready:
        recovering = old is not None and old.get("reason") in ("WaitForRecovery", "Recovered")
        cond = ("PodsReady", "True", "Recovered" if recovering else "Started",
                "All pods reached readiness and the workload is running")
    elif old is None:
        cond = ("PodsReady", "False", "WaitForStart", NOT_READY)
    elif old.get("status") == "True":
        cond = ("PodsReady", "False", "WaitForRecovery", "At least one pod has failed, waiting for recovery")
    else:
        return []
    if old is not None and (old.get("status"), old.get("reason")) == cond[1:3]:
        return []
    return [WorkloadWrite(workload.name, "status", {"metadata": {"resourceVersion": workload.resource_version},
                                                    "status": {"conditions": _with(workload, now, cond)}})]


def activate(workload: Workload, active: bool) -> WorkloadWrite:
    """Deactivate the Workload for its job's suspension (marked so), or reactivate one so deactivated."""
    return WorkloadWrite(workload.name, "", {"metadata": {"annotations": {SUSPENDED: None if active else "true"}},
                                             "spec": {"active": active}})
