"""The rules of a job on several nodes (spec.resources.nodes: M): its attempt is a gang of M pods. Pure.

Created together on M nodes (memstrata.operator.scheduling), Running once every pod runs, Succeeded once every
pod succeeded. One pod failing or lost fails the whole attempt (memstrata.operator.lifecycle counts it once and
stops the others). `activePod` names node rank 0's pod and status `nodes` the attempt's nodes by node rank, so
the attempt's other pods' names follow from them even after a pod is gone.

An attempt whose pods could not all be created (a ResourceQuota allowing fewer than M pods, a refused request)
is not recorded as the current one (`activePod`), but why the job waits is, for a job on one node as on several,
and, when some of its pods exist, its nodes and plan (`unfinished`): the next reconcile
creates the missing pods of that same attempt on the same nodes (`rest`) instead of deleting the others and
starting another attempt that would fail alike - pods created and deleted in a loop, the attempt count climbing.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping, Sequence

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.strataplan import Plan
from memstrata.operator.actions import CreateAttempt, Decision, DeletePods, PatchStatus
from memstrata.operator.conditions import StatusBuilder
from memstrata.operator.names import attempt_of, pod_name
from memstrata.operator.observe import JobView, PodView


def expected(job: str, active: str | None, nodes: Sequence[str]) -> list[str]:
    """The current attempt's pods by node rank: [activePod] for a single-node job, none when no attempt runs."""
    if not active:
        return []
    attempt = attempt_of(job, active)
    if attempt is None or len(nodes) <= 1:
        return [active]
    return [pod_name(job, attempt, r, len(nodes)) for r in range(len(nodes))]


def completed(pods: Sequence[PodView], nodes: int) -> list[PodView]:
    """The pods of the first attempt whose every node rank succeeded (one pod for a single-node job)."""
    by_attempt: dict[int, dict[int, PodView]] = {}
    for p in sorted(pods, key=lambda p: p.name):
        if p.phase == "Succeeded":
            by_attempt.setdefault(p.attempt, {}).setdefault(p.node_rank if nodes > 1 else 0, p)
    for attempt in sorted(by_attempt):
        ranks = by_attempt[attempt]
        if all(r in ranks for r in range(nodes)):
            return [ranks[r] for r in sorted(ranks)]
    return []


def describe(pods: Sequence[PodView]) -> str:
    return f"pod {pods[0].name}" if len(pods) == 1 else "pods " + ", ".join(p.name for p in pods)


def track(b: StatusBuilder, pods: Sequence[PodView], retrying: bool) -> bool:
    """Record where the attempt's pods (by node rank) stand; whether one of them waits for room."""
    attempt = pods[0].attempt
    b.set("attempts", max(int(b.get("attempts") or 0), attempt + 1))
    if pods[0].node:
        b.set("node", pods[0].node)
    devices = [d for p in pods for d in p.devices]  # each node's pool names its own: no two pods' collide
    if devices and b.get("devices") != devices:
        b.set("devices", devices)
    bound = "; ".join(f"pod {p.name} is bound to node {p.node}" for p in pods if p.node)
    if all(p.phase in ("Running", "Succeeded") for p in pods):
        running = "; ".join(f"pod {p.name} is {'running' if p.phase == 'Running' else 'done'} on {p.node}"
                            for p in pods)
        b.phase("Running", running)
        b.condition("Scheduled", "True", "PodScheduled", bound)
        b.condition("Running", "True", "PodRunning", running)
        b.condition_if_true("Restarting", "False", "Restarted", f"attempt {attempt + 1} is running")
        return False
    if all(p.node for p in pods):
        b.phase("Restarting" if retrying else "Scheduled", bound)
        b.condition("Scheduled", "True", "PodScheduled", bound)
        return False
    unbound = [p for p in pods if not p.node]
    b.phase("Restarting" if retrying else "Created",
            "; ".join(f"pod {p.name} waits for the scheduler" for p in unbound))
    stuck = [p for p in unbound if p.unschedulable]
    if stuck:
        b.condition("Scheduled", "False", "Unschedulable", "; ".join(f"pod {p.name}: {p.reason}" for p in stuck))
    return bool(stuck)


def blame(ended: Sequence[PodView]) -> list[tuple[PodView, str]]:
    """Per attempt (in order) of the pods seen ending in one reconcile, the one that failed it and the message
    saying so. With gloo a peer's end reaches the others at once as a connection error, so the cause is the pod
    deleted under the attempt (evicted, its node lost), else the one whose container ended first; the message
    says the others ended after it."""
    out: list[tuple[PodView, str]] = []
    for attempt in sorted({p.attempt for p in ended}):
        root, *others = sorted((p for p in ended if p.attempt == attempt), key=lambda p: (
            not (p.deleting and not p.terminal), p.finished_at.timestamp() if p.finished_at else float("inf"),
            p.node_rank))
        after = f"; {describe(others)} of the attempt failed after it" if others else ""
        out.append((root, root.describe_gang_failure() + after))
    return out


def unfinished(job: JobView, now: datetime, create: CreateAttempt, error: str, partly: bool = True) -> Decision:
    """The status to record when `create` raised `error` before all of its pods existed: why the job waits, in
    its Created condition, Pending (or still Restarting: a retry). When some of them exist (`partly`), also the
    attempt's nodes and plan (for `rest`) and the attempt counted; the previous attempt's status.workers go: they
    are not this one's. When none does, nothing of the attempt: the next try is the same attempt, made whole."""
    b = StatusBuilder(job.status, now, job.malformed)
    made = ", ".join(pod_name(job.name, create.attempt, r, len(create.placed)) for r in range(len(create.placed)))
    if partly:
        b.set("attempts", max(int(b.get("attempts") or 0), create.attempt + 1))
        b.set("node", create.node)
        b.set("nodes", list(create.placed))
        b.set("plan", create.plan.model_dump(mode="json"))
        b.set("workers", {k: w for k, w in (b.get("workers") or {}).items()
                          if isinstance(w, Mapping) and w.get("attempt") == create.attempt} or None)
        message = (f"not every pod of attempt {create.attempt + 1} ({made}) could be created; the missing ones are "
                   f"created again on the same nodes: {error[:800]}")
    else:
        message = f"attempt {create.attempt + 1} ({made}) could not be created; it is tried again: {error[:800]}"
    if b.get("phase") == "Restarting":
        b.set("message", message)
    else:
        b.phase("Pending", message)
    b.condition("Created", "False", "PodCreateFailed", message)
    patch = b.patch()
    return Decision(((PatchStatus(patch),) if patch else ()) + tuple(b.events()))


def rest(status: Mapping[str, Any], plan: Plan | None, pods: Sequence[PodView], nodes: int,
         architecture: ModelArchitecture | None) -> CreateAttempt | DeletePods:
    """What to do with an attempt whose pods are not all there and that is not recorded as the current one (none
    of its pods ended: no failure). With the nodes and plan `unfinished` recorded for it (`plan`: status.plan as
    read, JobView.plan), create its missing pods on their nodes (its existing pods are kept); else (a reconcile
    stopped between its creates, before it recorded anything) delete its pods: the next attempt is created whole."""
    attempt, placed = pods[0].attempt, list(status.get("nodes") or [])
    known = int(status.get("attempts") or 0) == attempt + 1 and len(placed) == nodes
    if plan is not None and known and not any(
            p.node_rank >= nodes or (p.node and p.node != placed[p.node_rank]) for p in pods):
        missing = set(range(nodes)) - {p.node_rank for p in pods}
        return CreateAttempt(attempt, placed[0], plan, architecture, tuple(placed), tuple(sorted(missing)))
    return DeletePods(tuple(p.name for p in pods), f"attempt {attempt + 1} was not created whole "
                                                   f"({len(pods)} of {nodes} pods)")
