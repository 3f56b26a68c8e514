"""The FineTuneJob state machine. Pure: (job, its pods, now, a placer) -> Decision.

Level-triggered: the decision depends only on what is observed now, so running
it twice, or after an operator restart, asks for nothing new. Two facts cannot
be observed and are kept in status: which pod is the current attempt
(`activePod`, written only after the pod exists) and which pods already failed
(`failedPods`), so a failed pod that someone deletes still counts. Likewise what
the runtime reported that the user was already told (memstrata.operator.announce:
the Checkpointed and Resumed events, once each).

Phases: Pending -> Created -> Scheduled -> Running -> Succeeded | Failed, with
Restarting between attempts, Suspended while spec.runPolicy.suspend is true, and Queued while a job queued
through Kueue waits for its Workload to be admitted (again, after a preemption: memstrata.operator.kueue). A job whose
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

What the pods say of the attempts (which failed, which is current, the model's shape) is read and recorded by
memstrata.operator.attempts; this module decides from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Callable, Sequence

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.report import format_duration
from memstrata.operator import attempts, gang, kueue
from memstrata.operator.announce import announce
from memstrata.operator.actions import AddFinalizer, CleanupChildren, CreateAttempt, Decision, DeletePods
from memstrata.operator.attempts import Run
from memstrata.operator.conditions import StatusBuilder
from memstrata.operator.jobpolicy import JobPolicy
from memstrata.operator.names import FINALIZER, attempt_of
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
    kueue: bool = False
    """Whether jobs labelled kueue.x-k8s.io/queue-name are queued through Kueue (memstrata.operator.kueue)."""

    def backoff(self, failures: int) -> float:
        if failures <= 0 or self.backoff_base_seconds <= 0:
            return 0.0
        return min(self.backoff_base_seconds * 2 ** (failures - 1), self.backoff_max_seconds)


Placer = Callable[[FineTuneJobSpec], Placement]
TERMINAL_PHASES = ("Succeeded", "Failed")


def decide(job: JobView, pods: Sequence[PodView], now: datetime, place: Placer,
           policy: LifecyclePolicy = LifecyclePolicy(), queue: kueue.Queue | None = None) -> Decision:
    """`queue`: what the edge read for a job queued through Kueue (memstrata.operator.kueue); None for the rest."""
    if job.deleting:
        if FINALIZER not in job.finalizers:
            return Decision()  # released already; the API server finishes the deletion
        # Pods still listed (even terminating) keep the finalizer: no orphan outlives its job.
        return Decision((CleanupChildren(release=not pods),), requeue_after=1.0 if pods else None)
    decision = _decide(job, pods, now, place, policy, queue)
    if FINALIZER not in job.finalizers:
        return Decision((AddFinalizer(),) + decision.actions, decision.requeue_after, decision.waiting_for_room)
    return decision


def fail(job: JobView, now: datetime, reason: str, message: str) -> Decision:
    """The job Failed for a reason the edge found while acting (it has no pod of this attempt)."""
    return Run(job, (), now, StatusBuilder(job.status, now, job.malformed)).finish("Failed", reason, message)


def _decide(job: JobView, pods: Sequence[PodView], now: datetime, place: Placer,
            policy: LifecyclePolicy, queue: kueue.Queue | None) -> Decision:
    run = Run(job, [p for p in pods if not p.inspection], now, StatusBuilder(job.status, now, job.malformed),
              inspections=sorted((p for p in pods if p.inspection), key=lambda p: p.name))
    phase = job.status.get("phase")
    workload = queue.workload if queue is not None else None
    if phase in TERMINAL_PHASES:
        run.stop_active(f"the job already {phase.lower()}")
        run.actions += kueue.on_terminal(workload, phase, job.status.get("message") or phase, run.b.now_str)
        run.expire_after_ttl(parse_time(job.status.get("completionTime")) or now)
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
        run.actions += kueue.on_suspend(workload, run.pods, run.b.now_str)
        return _suspend(run)
    if phase == "Suspended":
        run.b.condition("Suspended", "False", "Resumed", "spec.runPolicy.suspend was set to false")

    succeeded = gang.completed(run.pods, job.spec.resources.nodes)
    if succeeded:  # a finished run counts even if the deadline passed while we were not looking
        return run.finish("Succeeded", "PodSucceeded", f"{gang.describe(succeeded)} completed")

    if (expired := _deadline(run)) is not None:
        return expired
    failures = attempts.count_failures(run)
    limit = policy_.backoff_limit
    if len(failures) > limit:
        last = (run.b.get("lastFailure") or {}).get("message") or "the last attempt failed"
        return run.finish("Failed", "BackoffLimitExceeded",
                          f"{last}; spec.runPolicy.backoffLimit is {limit}, "
                          f"so {limit + 1} attempt(s) were allowed and all failed")
    if (held := kueue.admission(run, queue, policy.kueue)) is not None:
        return held

    if job.spec.resources.nodes > 1:
        return _gang(run, failures, place, policy)
    current = sorted(run.active, key=lambda p: p.attempt)
    if current:
        if len(current) > 1:  # only possible if someone copied a pod; keep the newest
            run.actions.append(DeletePods(tuple(p.name for p in current[:-1]), "duplicate attempt"))
        return attempts.track(run, current[-1], failures)
    shape = attempts.planned_spec(run)
    if isinstance(shape, Decision):
        return shape
    return _start_attempt(run, failures, place, policy, *shape)


def _deadline(run: Run) -> Decision | None:
    """The job Failed when it ran longer than spec.runPolicy.activeDeadlineSeconds; else when to look again."""
    deadline = run.job.spec.run_policy.active_deadline_seconds if run.job.spec else None
    start = parse_time(run.job.status.get("startTime"))
    if not deadline or start is None:
        return None
    left = (start + timedelta(seconds=deadline) - run.now).total_seconds()
    if left <= 0:
        return run.finish("Failed", "DeadlineExceeded",
                          f"the job ran longer than spec.runPolicy.activeDeadlineSeconds ({deadline}s)")
    run.requeue.append(left)
    return None


def _suspend(run: Run) -> Decision:
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


def _gang(run: Run, failures: list[str], place: Placer, policy: LifecyclePolicy) -> Decision:
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
        return attempts.track_gang(run, [p for p in run.pods if p.attempt == newest and not p.deleting], failures)
    shape = attempts.planned_spec(run)
    if isinstance(shape, Decision):
        return shape
    return _start_attempt(run, failures, place, policy, *shape)


def _start_attempt(run: Run, failures: list[str], place: Placer, policy: LifecyclePolicy,
                   spec: FineTuneJobSpec, architecture: ModelArchitecture | None) -> Decision:
    b = run.b
    limit = spec.run_policy.backoff_limit
    retrying = attempts.is_retrying(run, failures)
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
    create = CreateAttempt(attempts.next_attempt(b.get("attempts"), run.pods), placement.node, placement.plan,
                           architecture, placed)
    return attempts.record_attempt(run, failures, create, placement.message)
