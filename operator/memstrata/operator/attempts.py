"""A job's attempts, as its pods show them: one reconcile's decision in the making (Run), the spec an attempt is
planned with (the model's shape, read by the inspection pod where the spec does not state it), the failed attempts
(each counted once, a gang's too), whether the next attempt replaces a failed one, tracking the current attempt
(one pod or a gang), and recording a new one. Pure, like the state machine that drives them
(memstrata.operator.lifecycle), which decides when and where the next attempt starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Sequence

from pydantic import ValidationError

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.validation import describe_validation_error
from memstrata.operator import gang, inspection
from memstrata.operator.actions import (
    Action, CreateAttempt, CreateInspection, Decision, DeleteJob, DeletePods, Event, PatchStatus,
)
from memstrata.operator.conditions import StatusBuilder
from memstrata.operator.names import attempt_of, inspect_pod_name, pod_name
from memstrata.operator.observe import JobView, PodView, parse_time


@dataclass
class Run:
    """One reconcile's decision in the making: the job and its pods as observed, the status being built, and the
    actions and requeues gathered so far; `done` makes the Decision of them."""

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
        self.expire_after_ttl(self.now)
        return self.done()

    def expire_after_ttl(self, completed: datetime) -> None:
        """Delete the job once spec.runPolicy.ttlSecondsAfterFinished has passed since `completed`."""
        ttl = self.job.spec.run_policy.ttl_seconds_after_finished if self.job.spec else None
        if ttl is None:
            return
        left = (completed + timedelta(seconds=ttl) - self.now).total_seconds()
        if left <= 0:
            self.actions.append(DeleteJob(f"ttlSecondsAfterFinished ({ttl}s) passed"))
        else:
            self.requeue.append(left)


def planned_spec(run: Run) -> Decision | tuple[FineTuneJobSpec, ModelArchitecture | None]:
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


def count_failures(run: Run) -> list[str]:
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


def _expected(run: Run) -> list[str]:
    return gang.expected(run.job.name, run.b.get("activePod"), run.b.get("nodes") or [])


def track_gang(run: Run, pods: list[PodView], failures: list[str]) -> Decision:
    job, b = run.job, run.b
    assert job.spec is not None
    nodes = job.spec.resources.nodes
    pods = sorted(pods, key=lambda p: p.node_rank)
    first = pod_name(job.name, pods[0].attempt, 0, nodes)
    if b.get("activePod") != first:
        if {p.node_rank for p in pods} != set(range(nodes)):  # created in part (gang.rest): the rest, or anew
            shape = planned_spec(run)
            if isinstance(shape, Decision):
                return shape
            rest = gang.rest(job.status, job.plan, pods, nodes, shape[1])
            if isinstance(rest, CreateAttempt):
                return record_attempt(run, failures, rest, f"completing attempt {pods[0].attempt + 1}, created in part")
            run.actions.append(rest)
            run.requeue.append(1.0)
            return run.done()
        b.set("activePod", first)  # adopted after a restart between create and status patch
        b.set("nodes", [p.node or "" for p in pods])
    run.waiting = gang.track(b, pods, is_retrying(run, failures))
    return run.done()


def is_retrying(run: Run, failures: list[str]) -> bool:
    """Whether the next (or current) attempt replaces a failed one, so that it waits out a backoff and the job
    is Restarting: some attempt failed and the job was not unsuspended since the last failure. Suspension is
    the user's pause, not a failure: an attempt after it starts at once, as the first one did."""
    if not failures:
        return False
    failed = parse_time((run.b.get("lastFailure") or {}).get("time"))
    unsuspended = next((parse_time(c.get("lastTransitionTime")) for c in run.b.get("conditions") or []
                        if c.get("type") == "Suspended" and c.get("status") == "False"), None)
    return failed is None or unsuspended is None or failed >= unsuspended


def track(run: Run, pod: PodView, failures: list[str]) -> Decision:
    b = run.b
    retrying = is_retrying(run, failures)
    if b.get("activePod") != pod.name:  # adopted after a restart between create and status patch
        b.set("activePod", pod.name)
    b.set("attempts", max(int(b.get("attempts") or 0), pod.attempt + 1))
    if pod.node:
        b.set("node", pod.node)
    if pod.devices and b.get("devices") != list(pod.devices):
        b.set("devices", list(pod.devices))
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


def record_attempt(run: Run, failures: list[str], create: CreateAttempt, why: str) -> Decision:
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
    if not is_retrying(run, failures):
        b.phase("Created", message)
    # The first pod's event comes with the Created condition; a later one's (a retry, or the pod after an
    # unsuspend) needs its own, as the condition stays True.
    created_before = any(c.get("type") == "Created" and c.get("status") == "True" for c in b.get("conditions") or [])
    b.condition("Created", "True", "PodCreated", message)
    if created_before:
        run.actions.append(Event("Normal", "PodCreated", message))
    return run.done()


def next_attempt(recorded: Any, pods: Sequence[PodView]) -> int:
    """One past every attempt ever made: the status counter, or any pod seen (a crash may
    have come between creating a pod and recording it)."""
    return max([int(recorded or 0)] + [p.attempt + 1 for p in pods])
