"""Kueue: a FineTuneJob labelled `kueue.x-k8s.io/queue-name` waits in that LocalQueue until Kueue admits it. Pure.

The route is the one Kueue documents for a controller written outside Kueue: the operator creates the job's
Workload and follows it, as Kueue's own job integrations do (its jobframework). Kueue's pod integration was the
other route, and is not taken: it queues pods that exist, so a queued job would have its pods (and, under DRA,
their claims) waiting in the cluster, and a preempted pod group is not brought back by Kueue.

The Workload (one per job, `names.workload_name`, owned by the job: deleted with it):
- one podSet of spec.resources.nodes pods, so Kueue admits all of a multi-node job's pods or none (a gang);
- each pod's requests as the operator will create it (render.container_requests: GPUs, NVMe namespaces, CXL GiB,
  the memory limit the plan sets), from the plan the job would have on the best node that can ever hold it;
- the priority of the WorkloadPriorityClass named by the job's `kueue.x-k8s.io/priority-class` label.

What the job does with it (decide):
- no Workload yet: create it; the job is Queued, with no pod and no device;
- not admitted: Queued, the condition saying why in Kueue's words (the Workload's QuotaReserved message);
- admitted: attempts are placed and created as without Kueue, on nodes the admission allows (placement_filter);
- evicted (preempted, deactivated): its pods are deleted; once none is left the admission is cleared, as Kueue's
  integrations do, so Kueue queues it again. Not a failure: the next admission starts a new attempt, and its
  runtime resumes from the job's latest checkpoint;
- finished (Succeeded, Failed): the Workload is marked Finished, so Kueue releases the quota at once;
- suspended by its user: the Workload is deactivated (spec.active false), so it holds no quota.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from memstrata.api.finetunejob import API_VERSION as JOB_API_VERSION, KIND as JOB_KIND, FineTuneJobSpec
from memstrata.operator import attempts, names
from memstrata.operator.actions import Action, CreateWorkload, Decision, DeletePods, Event, WorkloadWrite
from memstrata.operator.attempts import Run
from memstrata.operator.observe import JobView, PodView
from memstrata.operator.render import container_requests
from memstrata.operator.scheduling import Placement

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
PLURAL = "workloads"
QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_LABEL = f"{GROUP}/priority-class"
PODSET = "workers"
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
    owner_uid: str
    resource_version: str
    conditions: Mapping[str, Mapping[str, Any]]  # by type
    admission: Mapping[str, Any] | None
    active: bool = True
    queue: str = ""
    count: int = 1
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
    owner: Mapping[str, Any] = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), {})
    podsets = spec.get("podSets") or [{}]
    container = ((podsets[0].get("template") or {}).get("spec") or {}).get("containers") or [{}]
    requests = (container[0].get("resources") or {}).get("requests") or {}
    return Workload(
        name=str(meta.get("name") or ""), owner_uid=str(owner.get("uid") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
        conditions={str(c.get("type")): c for c in status.get("conditions") or []},
        admission=status.get("admission"), active=spec.get("active", True) is not False,
        queue=str(spec.get("queueName") or ""),
        count=int(podsets[0].get("count") or 1), requests={str(k): _quantity(v) for k, v in requests.items()})


def _quantity(value: Any) -> int:
    """The operator's own quantities: plain integers (bytes for memory), as workload_body writes them."""
    try:
        return int(str(value))
    except ValueError:
        return -1  # not the operator's write: no node fits it, so nothing is placed against it


def workload_body(job: JobView, spec: FineTuneJobSpec, requests: Mapping[str, int],
                  priority: tuple[str, int] | None) -> dict[str, Any]:
    """The job's Workload: `requests` each pod's (render.container_requests); `priority`: the
    WorkloadPriorityClass named by the job's label and its value."""
    quantities = {r: str(n) for r, n in sorted(requests.items())}
    container = {"name": names.CONTAINER, "image": spec.image,
                 "resources": {"requests": quantities, "limits": quantities}}
    body: dict[str, Any] = {
        "apiVersion": API_VERSION, "kind": "Workload",
        "metadata": {
            "name": names.workload_name(job.name, job.uid), "namespace": job.namespace,
            "labels": names.child_labels(job.name, job.uid),
            "ownerReferences": [{"apiVersion": JOB_API_VERSION, "kind": JOB_KIND, "name": job.name,
                                 "uid": job.uid, "controller": True, "blockOwnerDeletion": True}]},
        "spec": {
            "queueName": queue_of(job),
            "active": not spec.run_policy.suspend,
            "podSets": [{"name": PODSET, "count": spec.resources.nodes,
                         "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}]},
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

def _condition(type_: str, status: str, reason: str, message: str, now: str,
               old: Mapping[str, Any] | None) -> dict[str, Any]:
    since = old.get("lastTransitionTime", now) if old is not None and old.get("status") == status else now
    return {"type": type_, "status": status, "reason": reason, "message": message[:32768],
            "lastTransitionTime": since}


def _with(workload: Workload, now: str, *conds: tuple[str, str, str, str]) -> list[dict[str, Any]]:
    out = {t: dict(c) for t, c in workload.conditions.items()}
    for type_, status, reason, message in conds:
        out[type_] = _condition(type_, status, reason, message, now, workload.conditions.get(type_))
    return list(out.values())


def release(workload: Workload, now: str) -> WorkloadWrite:
    """Clear an evicted Workload's admission once the job's pods are gone: Kueue then queues it again (what
    Kueue's own integrations write, jobframework's UnsetQuotaReservationWithCondition)."""
    evicted = workload.evicted or {}
    reason, message = str(evicted.get("reason") or "Evicted"), str(evicted.get("message") or "evicted")
    conditions = _with(workload, now,
                       ("QuotaReserved", "False", "Pending", message),
                       ("Admitted", "False", "NoReservation", "The workload has no reservation"),
                       ("Requeued", "True" if reason in REQUEUED_BY_KUEUE else "False", reason, message))
    return WorkloadWrite(workload.name, "status", {"metadata": {"resourceVersion": workload.resource_version},
                                                   "status": {"admission": None, "conditions": conditions}})


def finish(workload: Workload, phase: str, message: str, now: str) -> WorkloadWrite:
    """The job ended: Finished, so Kueue releases its quota."""
    conditions = _with(workload, now, ("Finished", "True", phase, message))
    return WorkloadWrite(workload.name, "status", {"metadata": {"resourceVersion": workload.resource_version},
                                                   "status": {"conditions": conditions}})


def pods_ready(workload: Workload, pods: Sequence[PodView], nodes: int, now: str) -> list[Action]:
    """The Workload's PodsReady condition, which Kueue's waitForPodsReady waits on (and evicts a Workload whose
    pods do not all run in time): True once every pod of the current attempt runs."""
    ready = sum(1 for p in pods if p.active and p.phase == "Running") >= nodes
    old = workload.conditions.get("PodsReady")
    if old is not None and old.get("status") == ("True" if ready else "False"):
        return []
    if ready:
        cond = ("PodsReady", "True", "PodsReady", "All pods reached readiness and the workload is running")
    else:
        cond = ("PodsReady", "False", "WaitForRecovery" if old is not None else "WaitForStart",
                "Not all pods are ready or succeeded")
    return [WorkloadWrite(workload.name, "status", {"metadata": {"resourceVersion": workload.resource_version},
                                                    "status": {"conditions": _with(workload, now, cond)}})]


def activate(workload: Workload, active: bool) -> WorkloadWrite:
    return WorkloadWrite(workload.name, "", {"spec": {"active": active}})


# -- the decisions --------------------------------------------------------------------------------------------

def on_terminal(workload: Workload | None, phase: str, message: str, now: str) -> list[Action]:
    if workload is None or workload.finished:
        return []
    return [finish(workload, phase, message, now)]


def _running(pods: Sequence[PodView]) -> bool:
    """Whether a pod of the job may still hold what it was admitted for: one being deleted runs until it exits."""
    return any(not p.terminal for p in pods)


def on_suspend(workload: Workload | None, pods: Sequence[PodView], now: str) -> list[Action]:
    """The user suspended the job: no quota held while it is (Kueue evicts a deactivated Workload)."""
    if workload is None:
        return []
    if workload.active:
        return [activate(workload, False)]
    if workload.evicted and workload.admission is not None and not _running(pods):
        return [release(workload, now)]
    return []


@dataclass(frozen=True)
class Held:
    """The job may not run now: why (the Queued condition's reason and message), and what to do about it."""

    reason: str
    message: str
    actions: tuple[Action, ...] = ()
    evicted: bool = False


def hold(job: JobView, workload: Workload | None, pods: Sequence[PodView], now: str) -> Held | None:
    """None when the job's Workload is admitted and its pods may run; otherwise why not and what to do: pods of a
    job that is not admitted are stopped, and an evicted Workload's admission cleared once they are gone."""
    if workload is None:
        return None  # the caller creates it (it needs the plan)
    queue = queue_of(job) or workload.queue
    actions: list[Action] = []
    if workload.active is False and not (job.spec and job.spec.run_policy.suspend):
        actions.append(activate(workload, True))  # unsuspended by its user
    if queue and queue != workload.queue and workload.admission is None:  # moved to another queue while it waits
        actions.append(WorkloadWrite(workload.name, "", {"spec": {"queueName": queue}}))
    if workload.admitted and workload.evicted is None:
        # (still admitted though deactivated: Kueue has not evicted it yet; reactivated, it runs on)
        return None if not actions else Held("Pending", f"Workload {workload.name} reactivated", tuple(actions))
    # The pods are deleted once the job's status no longer names them (activePod, written by this decision): a pod
    # deleted first and gone before that write lands would count as a failed attempt.
    stopping = tuple(p.name for p in pods if p.active) if job.status.get("activePod") is None else ()
    evicted = workload.evicted
    if evicted is not None:
        reason, message = str(evicted.get("reason") or "Evicted"), str(evicted.get("message") or "")
        if stopping:
            actions.insert(0, DeletePods(stopping, f"Kueue evicted the job's Workload: {reason}"))
        elif workload.admission is not None and not _running(pods):
            actions.append(release(workload, now))
        return Held(reason, f"evicted by Kueue ({reason}): {message}; it waits in LocalQueue {queue} to be "
                            "admitted again, and resumes from its latest checkpoint", tuple(actions), evicted=True)
    if stopping:  # a Workload that lost its admission some other way: its pods may not run either
        actions.insert(0, DeletePods(stopping, f"its Workload {workload.name} is not admitted"))
    reason, message = workload.waiting()
    return Held(reason, f"waiting in LocalQueue {queue}: {message}", tuple(actions))


@dataclass(frozen=True)
class Queue:
    """What the edge read for a queued job: its Workload (None: none yet), how the job would be placed on an
    empty cluster (its quota is that plan's requests), and the priority its label names (or why it has none)."""

    workload: Workload | None
    quota: Callable[[FineTuneJobSpec], Placement]
    priority: tuple[str, int] | None = None
    priority_error: str = ""


RECHECK_SECONDS = 30.0  # a queued job is looked at again this often even if no Workload event arrives


def admission(run: Run, queue: Queue | None, enabled: bool) -> Decision | None:
    """None when the job may run now; otherwise the decision that keeps it Queued. `queue`: None for a job not
    queued through Kueue; `enabled`: whether this operator queues jobs through Kueue at all (--kueue)."""
    if queue is not None:
        return gate(run, queue)
    if is_queued(run.job) and not enabled:
        not_queued(run)
    return None


def gate(run: Run, queue: Queue) -> Decision | None:
    """None when the job may run (its Workload is admitted); otherwise the decision that keeps it Queued."""
    b = run.b
    if queue.workload is None:
        return _create(run, queue)
    held = hold(run.job, queue.workload, run.pods, b.now_str)
    if held is None:
        b.condition("Queued", "False", "Admitted", f"Workload {queue.workload.name} admitted by ClusterQueue "
                                                   f"{queue.workload.cluster_queue}")
        run.actions += pods_ready(queue.workload, run.pods, run.job.spec.resources.nodes if run.job.spec else 1,
                                  b.now_str)
        return None
    run.actions += held.actions
    _queued(run, held.reason, held.message)
    return run.done()


def _queued(run: Run, reason: str, message: str) -> None:
    b = run.b
    b.phase("Queued", message)
    b.condition("Queued", "True", reason, message)
    for type_ in ("Running", "Restarting", "Scheduled"):
        b.condition_if_true(type_, "False", reason, message)
    # As a suspension: the pods being stopped are no failure, and the deadline counts running time only.
    b.set("activePod", None)
    b.set("startTime", None)
    run.requeue.append(RECHECK_SECONDS)


def _create(run: Run, queue: Queue) -> Decision:
    """The job has no Workload (a new job, or its Workload was deleted): stop what runs, and create it."""
    run.stop_active("its Kueue Workload is gone")
    shape = attempts.planned_spec(run)  # a model read from its directory is inspected first: the plan needs it
    if isinstance(shape, Decision):
        return shape
    spec = shape[0]
    if queue.priority_error:
        _queued(run, "PriorityClassNotFound", queue.priority_error)
        return run.done()
    placement = queue.quota(spec)
    if placement.outcome == "impossible":
        run.b.set("shortfalls", [s.wire() for s in placement.shortfalls])
        return run.finish("Failed", placement.reason, placement.message)
    if placement.outcome == "no-room" or placement.plan is None:  # no node to plan on yet: as without Kueue
        run.b.phase("Pending", placement.message)
        run.b.condition("Scheduled", "False", "Unschedulable", placement.message)
        run.requeue.append(RECHECK_SECONDS)
        run.waiting = True
        return run.done()
    body = workload_body(run.job, spec, container_requests(spec, placement.plan), queue.priority)
    run.actions.append(CreateWorkload(body))
    name = body["metadata"]["name"]
    run.b.set("workload", name)
    _queued(run, "WorkloadCreated", f"waiting in LocalQueue {queue_of(run.job)}: Workload {name} created; "
                                    "the job runs once Kueue admits it")
    return run.done()


def not_queued(run: Run) -> None:
    """A job labelled with a queue, under an operator that runs without Kueue: it runs unqueued, and says so."""
    message = (f"metadata.labels[{QUEUE_LABEL}] is {queue_of(run.job)!r}, but this operator runs without Kueue "
               "(the chart's kueue.enabled; the operator's --kueue): the job is not queued and counts against no quota")
    run.b.condition("Queued", "False", "NotQueued", message)
