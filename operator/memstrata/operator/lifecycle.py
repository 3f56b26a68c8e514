"""The FineTuneJob state machine. Pure: (job, its pods, now, a placer) -> Decision.

Level-triggered: the decision depends only on what is observed now, so running
it twice, or after an operator restart, asks for nothing new. Two facts cannot
be observed and are kept in status: which pod is the current attempt
(`activePod`, written only after the pod exists) and which pods already failed
(`failedPods`), so a failed pod that someone deletes still counts. Likewise what
the runtime reported that the user was already told (memstrata.operator.announce:
the Checkpointed and Resumed events, once each).

Phases: Pending -> Created -> Scheduled -> Running -> Succeeded | Failed, with
Restarting between attempts and Suspended while spec.runPolicy.suspend is true. A job whose
model.path comes without an architecture first stays Pending while an inspection pod reads the
directory's config.json (memstrata.operator.inspection); the shape it reports is kept in
status.modelArchitecture and every attempt is planned with it.
backoffLimit N allows N failed attempts to be retried: N+1 attempts in all.

Every new attempt - after a failed pod, after a pod deleted under it (a lost node, an eviction), after
suspend and unsuspend - is a new pod whose runtime config carries spec.checkpoint as the job states
it (memstrata.operator.render); the runtime resumes from the latest complete checkpoint there by
itself, so the operator passes nothing else. Only failures count against backoffLimit (`restarts`)
and only a failure delays the next attempt: suspending deletes the pod but is no failure, and a job
unsuspended after an old failure starts at once.

A job on several nodes (spec.resources.nodes: M) runs each attempt as a gang of M pods (memstrata.operator.gang):
one pod failing or lost fails the whole attempt, its other pods are deleted (no further failure: failures count
once per attempt), and the next attempt is M new pods after the backoff.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Sequence

from pydantic import ValidationError

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.validation import describe_validation_error
from memstrata.api.report import format_duration
from memstrata.operator import gang, inspection
from memstrata.operator.announce import announce
from memstrata.operator.actions import (
    Action, AddFinalizer, CleanupChildren, CreateAttempt, CreateInspection, Decision, DeleteJob, DeletePods, Event,
    PatchStatus,
)
from memstrata.operator.conditions import StatusBuilder
from memstrata.operator.jobpolicy import JobPolicy
from memstrata.operator.names import FINALIZER, attempt_of, inspect_pod_name, pod_name
from memstrata.operator.observe import JobView, PodView, format_time, parse_time
from memstrata.operator.scheduling import Placement


@dataclass(frozen=True)
class LifecyclePolicy:
    backoff_base_seconds: float = 10.0
    """Delay before the 2nd attempt; doubles per failure (the Job controller's rule)."""
    backoff_max_seconds: float = 360.0
    """Cap on that delay, as the Job controller's six minutes."""
    unschedulable_retry_seconds: float = 30.0
    """Re-place a waiting job this often even if no capacity event arrives (a safety net)."""
    jobs: JobPolicy = JobPolicy()
    """What a job may ask its pods for (volumes, image, command): a job that asks for more fails, with no pod."""

    def backoff(self, failures: int) -> float:
        if failures <= 0 or self.backoff_base_seconds <= 0:
            return 0.0
        return min(self.backoff_base_seconds * 2 ** (failures - 1), self.backoff_max_seconds)


Placer = Callable[[FineTuneJobSpec], Placement]
TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass
class _Run:
    job: JobView
    pods: Sequence[PodView]  # the training attempts
    now: datetime
    b: StatusBuilder
    inspections: Sequence[PodView] = ()  # the model inspection pod(s)
    actions: list[Action] = field(default_factory=list)
    requeue: list[float] = field(default_factory=list)
    waiting: bool = False

    @property
    def active(self) -> list[PodView]:
        return [p for p in self.pods if p.active]

    def done(self) -> Decision:
        patch = self.b.patch()
        actions: list[Action] = [a for a in self.actions if not isinstance(a, Event)]
        if patch:
            actions.append(PatchStatus(patch))
        actions += [a for a in self.actions if isinstance(a, Event)] + self.b.events()
        return Decision(tuple(actions), min(self.requeue) if self.requeue else None, self.waiting)

    def stop_active(self, why: str) -> None:
        active = self.active + [p for p in self.inspections if p.active]
        if active:
            self.actions.insert(0, DeletePods(tuple(p.name for p in active), why))

    def finish(self, phase: str, reason: str, message: str) -> Decision:
        self.stop_active(f"the job {phase.lower()}")
        b = self.b
        b.phase(phase, message)
        b.condition(phase, "True", reason, message)
        b.condition_if_true("Running", "False", reason, message)
        b.condition_if_true("Restarting", "False", reason, message)
        b.set("completionTime", b.now_str)
        b.set("activePod", None)
        self._ttl(self.now)
        return self.done()

    def _ttl(self, completed: datetime) -> None:
        ttl = self.job.spec.run_policy.ttl_seconds_after_finished if self.job.spec else None
        if ttl is None:
            return
        left = (completed + timedelta(seconds=ttl) - self.now).total_seconds()
        if left <= 0:
            self.actions.append(DeleteJob(f"ttlSecondsAfterFinished ({ttl}s) passed"))
        else:
            self.requeue.append(left)


def decide(job: JobView, pods: Sequence[PodView], now: datetime, place: Placer,
           policy: LifecyclePolicy = LifecyclePolicy()) -> Decision:
    if job.deleting:
        if FINALIZER not in job.finalizers:
            return Decision()  # released already; the API server finishes the deletion
        # Pods still listed (even terminating) keep the finalizer: no orphan outlives its job.
        return Decision((CleanupChildren(release=not pods),), requeue_after=1.0 if pods else None)
    decision = _decide(job, pods, now, place, policy)
    if FINALIZER not in job.finalizers:
        return Decision((AddFinalizer(),) + decision.actions, decision.requeue_after, decision.waiting_for_room)
    return decision


def fail(job: JobView, now: datetime, reason: str, message: str) -> Decision:
    """The job Failed for a reason the edge found while acting (it has no pod of this attempt)."""
    return _Run(job, (), now, StatusBuilder(job.status, now, job.malformed)).finish("Failed", reason, message)


def _decide(job: JobView, pods: Sequence[PodView], now: datetime, place: Placer,
            policy: LifecyclePolicy) -> Decision:
    run = _Run(job, [p for p in pods if not p.inspection], now, StatusBuilder(job.status, now, job.malformed),
               inspections=sorted((p for p in pods if p.inspection), key=lambda p: p.name))
    phase = job.status.get("phase")
    if phase in TERMINAL_PHASES:
        run.stop_active(f"the job already {phase.lower()}")
        run._ttl(parse_time(job.status.get("completionTime")) or now)
        return run.done()
    if job.spec is None:
        return run.finish("Failed", "InvalidSpec", job.spec_error)
    refused = policy.jobs.refusal(job.spec)
    if refused is not None:  # before any pod, the inspection pod included
        return run.finish("Failed", "NotAllowed", refused)
    # Whatever comes next (even suspension: a pod being stopped may still write a checkpoint), the runtime's
    # news is told. Not for a finished job: its runtime has nothing left to say.
    run.actions += announce(run.b)
    policy_ = job.spec.run_policy
    if policy_.suspend:
        return _suspend(run)
    if phase == "Suspended":
        run.b.condition("Suspended", "False", "Resumed", "spec.runPolicy.suspend was set to false")

    succeeded = gang.completed(run.pods, job.spec.resources.nodes)
    if succeeded:  # a finished run counts even if the deadline passed while we were not looking
        return run.finish("Succeeded", "PodSucceeded", f"{gang.describe(succeeded)} completed")

    start = parse_time(job.status.get("startTime"))
    if policy_.active_deadline_seconds and start is not None:
        left = (start + timedelta(seconds=policy_.active_deadline_seconds) - now).total_seconds()
        if left <= 0:
            return run.finish("Failed", "DeadlineExceeded",
                              f"the job ran longer than spec.runPolicy.activeDeadlineSeconds "
                              f"({policy_.active_deadline_seconds}s)")
        run.requeue.append(left)

    failures = _failures(run)
    limit = policy_.backoff_limit
    if len(failures) > limit:
        last = (run.b.get("lastFailure") or {}).get("message") or "the last attempt failed"
        return run.finish("Failed", "BackoffLimitExceeded",
                          f"{last}; spec.runPolicy.backoffLimit is {limit}, "
                          f"so {limit + 1} attempt(s) were allowed and all failed")

    if job.spec.resources.nodes > 1:
        return _gang(run, failures, place, policy)
    current = sorted(run.active, key=lambda p: p.attempt)
    if current:
        if len(current) > 1:  # only possible if someone copied a pod; keep the newest
            run.actions.append(DeletePods(tuple(p.name for p in current[:-1]), "duplicate attempt"))
        return _track(run, current[-1], failures)
    shape = _shape(run)
    if isinstance(shape, Decision):
        return shape
    return _start_attempt(run, failures, place, policy, *shape)


def _shape(run: _Run) -> Decision | tuple[FineTuneJobSpec, ModelArchitecture | None]:
    """The spec to plan with: as written when it states the model's shape; else with the shape the
    inspection pod read (in status.modelArchitecture, or from the pod that has just finished), or
    the decision that waits for that pod, creates it, or fails the job with its error."""
    job, b = run.job, run.b
    spec = job.spec
    assert spec is not None
    if spec.model.known_shape() is not None:
        return spec, None
    arch = inspection.learned(job.status)
    if arch is None:
        seen = inspection.read(list(run.inspections))
        if seen.outcome == "failed":
            b.condition("Inspected", "False", "ModelInspectionFailed", seen.message)
            return run.finish("Failed", "ModelInspectionFailed", seen.message)
        if seen.outcome != "succeeded":
            name = seen.pod or inspect_pod_name(job.name, job.uid)
            if seen.outcome == "none":
                run.actions.append(CreateInspection())
            message = (f"reading the shape of model.path {spec.model.path} from its config.json (pod {name})"
                       + (f"; {seen.message}" if seen.message else ""))
            b.phase("Pending", message)
            b.condition("Inspected", "False", "Inspecting", message)
            return run.done()
        arch = seen.architecture
        assert arch is not None
        b.set("modelArchitecture", arch.wire())
        b.condition("Inspected", "True", "ModelInspected",
                    f"{spec.model.path}/config.json: {inspection.describe(arch)}")
    # Its answer is kept: free the pod's node and volumes (a ReadWriteOnce claim) for the training pod.
    done = [p.name for p in run.inspections if not p.deleting]
    if done:
        run.actions.insert(0, DeletePods(tuple(done), "the model's shape is known"))
    try:
        return spec.with_architecture(arch), arch
    except ValidationError as exc:
        return run.finish("Failed", "InvalidSpec", f"the model directory's shape does not suit the job: "
                                                   f"{describe_validation_error(exc, 'spec')}")


def _suspend(run: _Run) -> Decision:
    run.stop_active("the job is suspended")
    b = run.b
    message = "spec.runPolicy.suspend is true" + ("; its pods were deleted" if run.active else "")
    b.phase("Suspended", message)
    b.condition("Suspended", "True", "Suspended", message)
    b.condition_if_true("Running", "False", "Suspended", message)
    # A backoff under way ends with the suspension: the next attempt starts when the job is unsuspended.
    b.condition_if_true("Restarting", "False", "Suspended", message)
    b.set("activePod", None)
    # The deadline counts running time only, as the Job controller's does.
    b.set("startTime", None)
    return run.done()


def _failures(run: _Run) -> list[str]:
    """Names of all failed attempts, recording newly observed ones (with their reason) in status."""
    known = list(run.b.get("failedPods") or [])
    expected = _expected(run)
    multi = len(expected) > 1 or bool(run.job.spec and run.job.spec.resources.nodes > 1)
    by_name = {p.name: p for p in run.pods}
    # One failure per attempt of a multi-node job: its other pods, ending with it or deleted for it, are no
    # further failures; nor is a pod we deleted ourselves (suspend), which is not the current attempt.
    done = {attempt_of(run.job.name, n) for n in known} if multi else set()
    ended = [p for p in run.pods if p.name not in known and p.attempt not in done
             and (p.phase == "Failed" or p.deleting and not p.terminal) and not (p.deleting and p.name not in expected)]
    blamed = gang.blame(ended) if multi else [(p, p.describe_failure()) for p in sorted(ended, key=lambda p: p.attempt)]
    new, message = [p.name for p, _ in blamed], (blamed[-1][1] if blamed else "")
    reason = blamed[-1][0].failure_reason if blamed else ""
    done |= {p.attempt for p, _ in blamed} if multi else set()
    nodes = run.b.get("nodes") or []
    for rank, name in enumerate(expected):
        if name in by_name or name in known or name in new or attempt_of(run.job.name, name) in done:
            continue
        new.append(name)
        where = f" (node rank {rank} on node {nodes[rank]})" if multi and rank < len(nodes) else ""
        message, reason = f"pod {name}{where} disappeared before it finished", "Disappeared"
        if multi:
            message += "; the attempt's other pods are stopped"
            done.add(attempt_of(run.job.name, name))
    if new:
        run.b.set("failedPods", known + new)
        # The reason from a fixed vocabulary; the message is the operator's, with at most a bounded, sanitised
        # quote of what the container wrote (observe.container_text).
        run.b.set("lastFailure", {"pod": new[-1], "reason": reason, "message": message, "time": run.b.now_str})
        run.b.set("message", message)
        run.b.set("activePod", None)
        run.b.condition_if_true("Running", "False", "PodFailed", message)
    return known + new


def _expected(run: _Run) -> list[str]:
    return gang.expected(run.job.name, run.b.get("activePod"), run.b.get("nodes") or [])


def _gang(run: _Run, failures: list[str], place: Placer, policy: LifecyclePolicy) -> Decision:
    """A multi-node job once no attempt is over (see the module's docstring): stop what is left of a failed
    attempt, track the current one, or start the next."""
    failed = {attempt_of(run.job.name, n) for n in failures}
    leftovers = [p for p in run.active if p.attempt in failed]
    if leftovers:
        run.actions.append(DeletePods(tuple(p.name for p in leftovers),
                                      f"another pod of attempt {leftovers[0].attempt + 1} ended it"))
    current = [p for p in run.active if p.attempt not in failed]
    if current:
        newest = max(p.attempt for p in current)
        older = [p.name for p in current if p.attempt != newest]
        if older:  # only possible if someone copied a pod; keep the newest
            run.actions.append(DeletePods(tuple(older), "duplicate attempt"))
        return _track_gang(run, [p for p in run.pods if p.attempt == newest and not p.deleting], failures)
    shape = _shape(run)
    if isinstance(shape, Decision):
        return shape
    return _start_attempt(run, failures, place, policy, *shape)


def _track_gang(run: _Run, pods: list[PodView], failures: list[str]) -> Decision:
    job, b = run.job, run.b
    assert job.spec is not None
    nodes = job.spec.resources.nodes
    pods = sorted(pods, key=lambda p: p.node_rank)
    first = pod_name(job.name, pods[0].attempt, 0, nodes)
    if b.get("activePod") != first:
        if {p.node_rank for p in pods} != set(range(nodes)):  # created in part (gang.rest): the rest, or anew
            shape = _shape(run)
            if isinstance(shape, Decision):
                return shape
            rest = gang.rest(job.status, job.plan, pods, nodes, shape[1])
            if isinstance(rest, CreateAttempt):
                return _create(run, failures, rest, f"completing attempt {pods[0].attempt + 1}, created in part")
            run.actions.append(rest)
            run.requeue.append(1.0)
            return run.done()
        b.set("activePod", first)  # adopted after a restart between create and status patch
        b.set("nodes", [p.node or "" for p in pods])
    run.waiting = gang.track(b, pods, _retrying(run, failures))
    return run.done()


def _retrying(run: _Run, failures: list[str]) -> bool:
    """Whether the next (or current) attempt replaces a failed one, so that it waits out a backoff and the job
    is Restarting: some attempt failed and the job was not unsuspended since the last failure. Suspension is
    the user's pause, not a failure: an attempt after it starts at once, as the first one did."""
    if not failures:
        return False
    failed = parse_time((run.b.get("lastFailure") or {}).get("time"))
    unsuspended = next((parse_time(c.get("lastTransitionTime")) for c in run.b.get("conditions") or []
                        if c.get("type") == "Suspended" and c.get("status") == "False"), None)
    return failed is None or unsuspended is None or failed >= unsuspended


def _track(run: _Run, pod: PodView, failures: list[str]) -> Decision:
    b = run.b
    retrying = _retrying(run, failures)
    if b.get("activePod") != pod.name:  # adopted after a restart between create and status patch
        b.set("activePod", pod.name)
    b.set("attempts", max(int(b.get("attempts") or 0), pod.attempt + 1))
    if pod.node:
        b.set("node", pod.node)
    if pod.phase == "Running":
        b.phase("Running", f"pod {pod.name} is running on {pod.node}")
        b.condition("Scheduled", "True", "PodScheduled", f"pod {pod.name} is bound to node {pod.node}")
        b.condition("Running", "True", "PodRunning", f"pod {pod.name} is running on {pod.node}")
        b.condition_if_true("Restarting", "False", "Restarted", f"attempt {pod.attempt + 1} is running")
    elif pod.node:
        b.phase("Restarting" if retrying else "Scheduled", f"pod {pod.name} is bound to node {pod.node}")
        b.condition("Scheduled", "True", "PodScheduled", f"pod {pod.name} is bound to node {pod.node}")
    else:
        b.phase("Restarting" if retrying else "Created", f"pod {pod.name} waits for the scheduler")
        if pod.unschedulable:
            b.condition("Scheduled", "False", "Unschedulable", pod.reason)
            run.waiting = True
    return run.done()


def _start_attempt(run: _Run, failures: list[str], place: Placer, policy: LifecyclePolicy,
                   spec: FineTuneJobSpec, architecture: ModelArchitecture | None) -> Decision:
    b = run.b
    limit = spec.run_policy.backoff_limit
    retrying = _retrying(run, failures)
    if retrying:
        wait = policy.backoff(len(failures))
        failure = b.get("lastFailure") or {}
        due = (parse_time(failure.get("time")) or run.now) + timedelta(seconds=wait)
        left = (due - run.now).total_seconds()
        # An absolute time, not "in 5s": a message that changed every reconcile would be a
        # status write (and an event loop) every reconcile.
        msg = (f"{failure.get('message') or 'an attempt failed'}; attempt {len(failures) + 1} of {limit + 1} "
               f"starts at {format_time(due)} (backoff {format_duration(wait)})")
        b.phase("Restarting", msg)
        b.condition("Restarting", "True", "BackoffAfterFailure", msg)
        if left > 0:
            run.requeue.append(left)
            return run.done()

    placement = place(spec)
    if placement.outcome == "impossible":
        b.set("shortfalls", [s.wire() for s in placement.shortfalls])
        return run.finish("Failed", placement.reason, placement.message)
    if placement.outcome == "no-room":
        if not retrying:
            b.phase("Pending", placement.message)
        b.condition("Scheduled", "False", "Unschedulable", placement.message)
        run.waiting = True
        run.requeue.append(policy.unschedulable_retry_seconds)
        return run.done()

    assert placement.node is not None and placement.plan is not None
    placed = placement.nodes if spec.resources.nodes > 1 else ()
    assert len(placed) == spec.resources.nodes or not placed, "the placement chose one node per node rank"
    b.set("workers", None)  # the last attempt's pods' reports, until this one's pods report
    return _create(run, failures, CreateAttempt(_next_attempt(b.get("attempts"), run.pods), placement.node,
                                                placement.plan, architecture, placed), placement.message)


def _create(run: _Run, failures: list[str], create: CreateAttempt, why: str) -> Decision:
    """Create the attempt's pods and record it as the current one (the reconciler patches status after the pods)."""
    job, b = run.job, run.b
    placed, attempt = create.nodes, create.attempt
    run.actions.append(create)
    made = ", ".join(f"{pod_name(job.name, attempt, r, len(placed))} for node {n}" for r, n in create.creates)
    message = f"created pod{'s' if len(create.creates) > 1 else ''} {made}: {why}"
    b.set("node", create.node)
    b.set("nodes", list(placed) if placed else None)
    b.set("plan", create.plan.model_dump(mode="json"))
    b.set("attempts", attempt + 1)
    b.set("activePod", pod_name(job.name, attempt, 0, len(placed)))
    b.set("restarts", len(failures))
    b.set("shortfalls", None)
    if b.get("startTime") is None:
        b.set("startTime", b.now_str)
    if not _retrying(run, failures):
        b.phase("Created", message)
    # The first pod's event comes with the Created condition; a later one's (a retry, or the pod after an
    # unsuspend) needs its own, as the condition stays True.
    created_before = any(c.get("type") == "Created" and c.get("status") == "True" for c in b.get("conditions") or [])
    b.condition("Created", "True", "PodCreated", message)
    if created_before:
        run.actions.append(Event("Normal", "PodCreated", message))
    return run.done()


def _next_attempt(recorded: Any, pods: Sequence[PodView]) -> int:
    """One past every attempt ever made: the status counter, or any pod seen (a crash may
    have come between creating a pod and recording it)."""
    return max([int(recorded or 0)] + [p.attempt + 1 for p in pods])
