"""The rules of a job on several nodes (spec.resources.nodes: M): its attempt is a gang of M pods. Pure.

Created together on M nodes (memstrata.operator.scheduling), Running once every pod runs, Succeeded once every
pod succeeded. One pod failing or lost fails the whole attempt (memstrata.operator.lifecycle counts it once and
stops the others). `activePod` names node rank 0's pod and status `nodes` the attempt's nodes by node rank, so
the attempt's other pods' names follow from them even after a pod is gone.
"""
from __future__ import annotations

from typing import Sequence

from memstrata.operator.conditions import StatusBuilder
from memstrata.operator.names import attempt_of, pod_name
from memstrata.operator.observe import PodView


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
