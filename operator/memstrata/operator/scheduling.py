"""Choosing the node for a job. Pure: (spec, nodes, usage) in, a Placement out.

Three answers, because a user acts differently on each:
- chosen: a node whose strata hold the job and that has room now;
- no room: some node could hold it, none has room now — wait (Pending/Unschedulable);
- impossible: no node could ever hold it — fail now, naming what is missing per stratum.

Among nodes with room the order is: fewest bytes on NVMe, then on CXL (Plan.slow_bytes:
slower strata cost step time), then fewest memstrata pods (spread), then the name (so the
same inputs give the same answer).

A job on several nodes (spec.resources.nodes: M) is a gang: M distinct nodes, all with room now, or none.
They are chosen among nodes whose plan for the job is the same (nodes of one hardware type), because one
runtime config serves every pod; the M best of the best such group, node rank 0 first. "Impossible" when
fewer than M nodes alike could ever hold the job.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.units import format_bytes
from memstrata.api.inventory import RESOURCE_MEMORY
from memstrata.operator.nodes import NodeView, Usage, free_now
from memstrata.operator.render import container_requests
from memstrata.plan import Plan, plan_job
from memstrata.api.strata import names, titles

Outcome = Literal["chosen", "no-room", "impossible"]
Planner = Callable[[FineTuneJobSpec, NodeView], Plan]


@dataclass(frozen=True)
class StratumShortfall:
    stratum: str
    missing_bytes: int
    message: str

    def wire(self) -> dict[str, object]:
        return {"stratum": self.stratum, "missingBytes": self.missing_bytes, "message": self.message}


@dataclass(frozen=True)
class Placement:
    outcome: Outcome
    message: str
    node: str | None = None  # node rank 0's
    plan: Plan | None = None
    nodes: tuple[str, ...] = ()  # every chosen node by node rank (node first)
    shortfalls: tuple[StratumShortfall, ...] = field(default_factory=tuple)  # for "impossible", per stratum
    reason: str = "InsufficientMemory"  # for "impossible": the Failed condition's reason


def place(spec: FineTuneJobSpec, nodes: Sequence[NodeView], usage: Mapping[str, Usage],
          planner: Planner | None = None) -> Placement:
    plan_for = planner or (lambda s, n: plan_job(s, n.inventory))  # type: ignore[arg-type]
    managed = [n for n in nodes if n.inventory is not None]
    if not managed:
        return Placement("no-room", f"no node publishes a memstrata inventory yet ({len(nodes)} nodes seen); "
                                    "is the memstrata node agent running?")
    ever: list[tuple[NodeView, Plan]] = []
    never: list[tuple[NodeView, Plan]] = []
    for node in sorted(managed, key=lambda n: n.name):
        plan = plan_for(spec, node)
        (ever if plan.feasible and not _over_capacity(spec, plan, node) else never).append((node, plan))
    if not ever:
        return _impossible(spec, never)
    # A pod would refuse to start (Plan.stock_swap_refusal, the runtime's rule): decided here, once, not per attempt.
    fits = [(node, plan) for node, plan in ever if plan.stock_swap_refusal() is None]
    if not fits:
        return Placement("impossible", f"{ever[0][1].stock_swap_refusal()} (on every node that can hold this "
                                       "job: only a node with DRAM enough would keep it off NVMe)",
                         reason="EngineCannotUseNamespaces")
    ever = fits

    ready: list[tuple[tuple[int, int, int, str], NodeView, Plan]] = []
    if spec.resources.nodes > 1 and _largest_group(ever) < spec.resources.nodes:
        return _too_few(spec, ever)
    waiting: list[str] = []
    for node, plan in ever:
        if not node.schedulable:
            waiting.append(f"{node.name}: {node.why_not}")
            continue
        free = free_now(node, usage.get(node.name))
        lacking = [f"{r} needs {_show(r, n)}, {_show(r, max(free[r], 0))} free"
                   for r, n in sorted(container_requests(spec, plan).items()) if n > free[r]]
        if lacking:
            waiting.append(f"{node.name}: {', '.join(lacking)}")
            continue
        nvme, cxl = plan.slow_bytes()
        spread = usage[node.name].memstrata_pods if node.name in usage else 0
        ready.append(((nvme, cxl, spread, node.name), node, plan))
    shown = "; ".join(waiting[:5]) + (f"; and {len(waiting) - 5} more" if len(waiting) > 5 else "")
    if spec.resources.nodes > 1:
        return _gang(spec, ever, ready, shown)
    if not ready:
        return Placement("no-room", f"{len(ever)} node(s) can hold this job but none has room now: {shown}")
    _, node, plan = min(ready, key=lambda r: r[0])
    nvme, cxl = plan.slow_bytes()
    return Placement("chosen", f"placed on {node.name} ({format_bytes(nvme)} on NVMe, {format_bytes(cxl)} on CXL)",
                     node=node.name, plan=plan, nodes=(node.name,))


def _plan_key(plan: Plan) -> str:
    """What the runtime and the pod take from a plan: where every byte goes and what the pod requests. Not the
    node's capacities or estimates: nodes of one type that report a few MiB apart still run the same plan."""
    return plan.model_dump_json(exclude={"strata", "update_io_seconds", "notes", "shortfalls"})


def _largest_group(ever: Sequence[tuple[NodeView, Plan]]) -> int:
    sizes: dict[str, int] = {}
    for _, plan in ever:
        sizes[_plan_key(plan)] = sizes.get(_plan_key(plan), 0) + 1
    return max(sizes.values(), default=0)


def _too_few(spec: FineTuneJobSpec, ever: Sequence[tuple[NodeView, Plan]]) -> Placement:
    need, alike = spec.resources.nodes, _largest_group(ever)
    fit = ", ".join(n.name for n, _ in ever[:5]) + (f" and {len(ever) - 5} more" if len(ever) > 5 else "")
    same = "" if alike == len(ever) else f" ({alike} of them alike: one runtime config serves every pod)"
    return Placement("impossible", f"spec.resources.nodes is {need}, but only {len(ever)} node(s) can ever hold "
                                   f"this job{same}: {fit}; {need} needed", reason="InsufficientNodes")


def _gang(spec: FineTuneJobSpec, ever: Sequence[tuple[NodeView, Plan]],
          ready: list[tuple[tuple[int, int, int, str], NodeView, Plan]], waiting: str) -> Placement:
    """M distinct nodes with room now and the same plan, or no room (nothing is created until all M fit)."""
    need = spec.resources.nodes
    groups: dict[str, list[tuple[tuple[int, int, int, str], NodeView, Plan]]] = {}
    for item in sorted(ready, key=lambda r: r[0]):
        groups.setdefault(_plan_key(item[2]), []).append(item)
    full = [g[:need] for g in groups.values() if len(g) >= need]
    if not full:
        most = max((len(g) for g in groups.values()), default=0)
        return Placement("no-room", f"spec.resources.nodes is {need}: {len(ever)} node(s) can hold this job but only "
                                    f"{most} alike have room now (all {need} are placed together or none)"
                                    + (f": {waiting}" if waiting else ""))
    chosen = min(full, key=lambda g: [r[0] for r in g])
    plan = chosen[0][2]
    nodes = tuple(n.name for _, n, _ in chosen)
    nvme, cxl = plan.slow_bytes()
    return Placement("chosen", f"placed on {', '.join(nodes)} ({format_bytes(nvme)} on NVMe, {format_bytes(cxl)} "
                               "on CXL, each)", node=nodes[0], plan=plan, nodes=nodes)


def _show(resource: str, n: int) -> str:
    return format_bytes(n) if resource == RESOURCE_MEMORY else str(n)


def _over_capacity(spec: FineTuneJobSpec, plan: Plan, node: NodeView) -> bool:
    """A pod asking for more of a resource than the node advertises can never be scheduled there."""
    return any(n > node.allocatable.get(r, 0) for r, n in container_requests(spec, plan).items())


def _impossible(spec: FineTuneJobSpec, never: list[tuple[NodeView, Plan]]) -> Placement:
    """Fail with the shortfall of the closest node, one entry per stratum."""
    def missing(item: tuple[NodeView, Plan]) -> tuple[int, int, str]:
        node, plan = item
        return (len({s.stratum for s in plan.shortfalls}), sum(s.missing_bytes for s in plan.shortfalls), node.name)

    node, plan = min(never, key=missing)
    spec_requests = container_requests(spec, plan)
    per: dict[str, list[str]] = OrderedDict()
    lost: dict[str, int] = {}
    for s in plan.shortfalls:
        per.setdefault(s.stratum, []).append(s.message)
        lost[s.stratum] = lost.get(s.stratum, 0) + s.missing_bytes
    for resource, n in sorted(spec_requests.items()):
        if n > node.allocatable.get(resource, 0):
            per.setdefault("resources", []).append(
                f"{resource}: needs {_show(resource, n)}, node advertises "
                f"{_show(resource, node.allocatable.get(resource, 0))}")
    known = names()
    order = [s for s in known if s in per] + [s for s in per if s not in known]
    shortfalls = tuple(
        StratumShortfall(s, lost.get(s, 0), "; ".join(dict.fromkeys(per[s]))) for s in order
    )
    detail = "; ".join(
        f"{titles().get(s.stratum, s.stratum)}"
        + (f" short by {format_bytes(s.missing_bytes)}" if s.missing_bytes else "") + f" [{s.message}]"
        for s in shortfalls)
    others = f" (and {len(never) - 1} other node(s) fit even less)" if len(never) > 1 else ""
    return Placement("impossible", f"no node can ever hold this job; closest is {node.name}{others}: {detail}",
                     node=None, plan=plan, shortfalls=shortfalls)


class PlanCache:
    """Plans keyed by (what the planner reads from the spec, the node's inventory minus its hostname).

    Nodes of one hardware type share an inventory, so 500 jobs on 50 identical nodes plan 1 time,
    not 25,000; bounded so a long-running operator does not grow without limit.
    """

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._plans: OrderedDict[tuple[str, str], Plan] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __call__(self, spec: FineTuneJobSpec, node: NodeView) -> Plan:
        assert node.inventory is not None  # place() only plans managed nodes
        key = (spec_key(spec), node.inventory_key)
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = plan_job(spec, node.inventory)
        self._plans[key] = plan
        if len(self._plans) > self._size:
            self._plans.popitem(last=False)
        return plan


def spec_key(spec: FineTuneJobSpec) -> str:
    return spec.model_dump_json(include={"model", "training", "resources", "memory"})
