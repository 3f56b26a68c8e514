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

from dataclasses import dataclass
from typing import Callable, Sequence

from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.operator import attempts
from memstrata.operator.actions import Action, CreateWorkload, Decision, DeletePods, WorkloadWrite
from memstrata.operator.attempts import Run
from memstrata.operator.kueuewire import (
    QUEUE_LABEL, Workload, activate, finish, is_queued, pods_ready, queue_of, release, workload_body,
)
from memstrata.operator.observe import JobView, PodView
from memstrata.operator.render import container_requests
from memstrata.operator.scheduling import Placement


# -- the decisions --------------------------------------------------------------------------------------------

def on_terminal(workload: Workload | None, phase: str, message: str, now: str) -> list[Action]:
    if workload is None or workload.finished:
        return []
    return [finish(workload, phase, message, now)]


def _running(pods: Sequence[PodView]) -> bool:
    """Whether a pod of the job still runs and is not being deleted. A deleted pod counts no more, as in Kueue's
    own Job integration: one on a lost node may stay Terminating for ever, and the node's room is still the
    scheduler's to guard until it is gone."""
    return any(p.active for p in pods)


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


def hold(job: JobView, workload: Workload | None, pods: Sequence[PodView], now: str) -> Held | None:
    """None when the job's Workload is admitted and its pods may run; otherwise why not and what to do: pods of a
    job that is not admitted are stopped, and an evicted Workload's admission cleared once they are gone."""
    if workload is None:
        return None  # the caller creates it (it needs the plan)
    queue = queue_of(job) or workload.queue
    actions: list[Action] = []
    if not workload.active and workload.suspended and not (job.spec and job.spec.run_policy.suspend):
        actions.append(activate(workload, True))  # unsuspended by its user
    if queue and queue != workload.queue and workload.admission is None:  # moved to another queue while it waits
        actions.append(WorkloadWrite(workload.name, "", {"metadata": {"resourceVersion": workload.resource_version},
                                                         "spec": {"queueName": queue}}))
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
        if not workload.active and not workload.suspended:
            return Held(reason, f"Kueue deactivated its Workload {workload.name} ({reason}): {message}; it runs "
                                "again only if the Workload is reactivated (spec.active: true), from its latest "
                                "checkpoint", tuple(actions))
        return Held(reason, f"evicted by Kueue ({reason}): {message}; it waits in LocalQueue {queue} to be "
                            "admitted again, and resumes from its latest checkpoint", tuple(actions))
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
        return not_queued(run)
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
    if run.active and run.job.status.get("activePod") is not None:  # as in hold: the status first, then the pods
        _queued(run, "WorkloadGone", "its Kueue Workload is gone: its pods are stopped, and it queues again")
        return run.done()
    run.stop_active("its Kueue Workload is gone")
    if not queue_of(run.job):
        _queued(run, "NoQueue", f"its Workload is gone and its {QUEUE_LABEL} label was removed: label it with a "
                                "LocalQueue to queue it again")
        return run.done()
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


def not_queued(run: Run) -> Decision:
    """A job labelled with a queue, under an operator that runs without Kueue: it waits, rather than run past the
    quota its submitter asked to be held to."""
    message = (f"metadata.labels[{QUEUE_LABEL}] is {queue_of(run.job)!r}, but this operator runs without Kueue "
               "(the chart's kueue.enabled; the operator's --kueue): install Kueue and upgrade the chart, or remove "
               "the label to run the job unqueued")
    run.b.phase("Pending", message)
    run.b.condition("Queued", "False", "NotQueued", message)
    run.requeue.append(RECHECK_SECONDS)
    return run.done()
