"""What the operator knows about nodes and the room left on them. Pure: dicts in, values out.

"Room now" is a node's allocatable minus the requests of the pods bound to it
that have not terminated — the same arithmetic the scheduler does for extended
resources — so the operator only creates a pod where the scheduler will bind it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from memstrata.api import strata
from memstrata.api.inventory import (
    RESOURCE_GPU, RESOURCE_MEMORY, NodeInventory, NodeNotManagedError, read_node, resource_capacity,
)
from memstrata.api.units import quantity_value
from memstrata.api.finetunejob import KIND
from memstrata.operator.claims import ANNOTATION_REQUESTS
from memstrata.operator.names import LABEL_JOB_UID

# Memory too: the training container requests its plan's host memory, so a node must have that much
# allocatable memory left, as the scheduler will check.
def resources() -> tuple[str, ...]:
    """Every resource a job's pod may request: each stratum's extended resource, and memory."""
    return (*(s.resource for s in strata.registry() if s.resource is not None), RESOURCE_MEMORY)

# Taints that the operator's pods tolerate: GPU nodes are commonly tainted so
# that only GPU workloads land there, and a fine-tune is one.
TOLERATED_TAINT_KEYS = frozenset({RESOURCE_GPU})

def quantity(value: str | int | None) -> int:
    """A resource amount on a Node or pod: absent is 0, else Kubernetes' Quantity.Value()
    (memstrata.api.units.quantity_value)."""
    return 0 if value is None else quantity_value(value)


@dataclass(frozen=True)
class NodeView:
    """One Node as the placement needs it."""

    name: str
    inventory: NodeInventory | None
    allocatable: Mapping[str, int]
    schedulable: bool
    why_not: str = ""  # why no pod can be placed there now (cordoned, NotReady, tainted)
    error: str = ""  # why the inventory is unusable
    inventory_key: str = ""  # identical inventories share plans (see placement)
    labels: Mapping[str, str] = field(default_factory=dict)  # a Kueue flavor's nodeLabels select nodes by them


def node_view(node: Mapping[str, Any], claimed: Iterable[str] = ()) -> NodeView:
    """One Node. `claimed`: the resources pods claim through DRA (--device-api dra): no device plugin reports
    them in the Node's allocatable, so they come from the node agent's inventory, counted as the plugin would."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    name = meta.get("name", "")
    inventory: NodeInventory | None
    try:
        read = read_node(node)
        inventory, error, key = read, "", read.model_dump_json(exclude={"hostname"})
    except NodeNotManagedError as exc:
        inventory, error, key = None, str(exc), ""
    alloc = status.get("allocatable") or {}
    allocatable = {r: quantity(alloc.get(r)) for r in resources()}
    if inventory is not None:
        counted = resource_capacity(inventory)
        allocatable.update({r: quantity(counted.get(r)) for r in claimed})
    why = _why_unschedulable(spec, status)
    return NodeView(name=name, inventory=inventory, allocatable=allocatable, schedulable=not why,
                    why_not=why, error=error, inventory_key=key, labels=dict(meta.get("labels") or {}))


def _why_unschedulable(spec: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    if spec.get("unschedulable"):
        return "cordoned"
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return "not Ready"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and taint.get("key") not in TOLERATED_TAINT_KEYS:
            return f"tainted {taint.get('key')}:{taint.get('effect')}"
    return ""


@dataclass(frozen=True)
class PodUse:
    """A pod bound to a node that still holds its resources."""

    key: str  # namespace/name
    node: str
    requests: Mapping[str, int]
    memstrata: bool  # one of ours: counts for spreading


def pod_use(pod: Mapping[str, Any]) -> PodUse | None:
    """The resources a pod holds on its node, or None if it holds none (unbound or terminated)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    node = spec.get("nodeName")
    if not node or status.get("phase") in ("Succeeded", "Failed"):
        return None
    requests = pod_requests(spec)
    for r, n in annotated_claims(meta).items():  # a memstrata pod's devices through its DRA claim
        requests[r] = requests.get(r, 0) + n
    return PodUse(
        key=f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        node=node,
        requests=requests,
        memstrata=LABEL_JOB_UID in (meta.get("labels") or {}),
    )


def annotated_claims(meta: Mapping[str, Any]) -> dict[str, int]:
    """What a memstrata pod's claim holds (its claims.ANNOTATION_REQUESTS), in extended-resource units; {} for any
    other pod (one a FineTuneJob does not own: anyone may write a label and an annotation), or an annotation that
    cannot be read."""
    raw = (meta.get("annotations") or {}).get(ANNOTATION_REQUESTS)
    uid = (meta.get("labels") or {}).get(LABEL_JOB_UID)
    owners = meta.get("ownerReferences") or []
    if not raw or not any(o.get("kind") == KIND and o.get("uid") == uid for o in owners):
        return {}
    try:
        counts = json.loads(raw)
    except ValueError:
        return {}
    known = set(resources())
    return {r: n for r, n in counts.items() if r in known and isinstance(n, int) and n > 0} \
        if isinstance(counts, dict) else {}


def pod_requests(spec: Mapping[str, Any]) -> dict[str, int]:
    """Extended-resource requests of a pod: the sum over containers, or the largest init container
    (init containers run one at a time), whichever is larger — the scheduler's rule."""
    def of(containers: Iterable[Mapping[str, Any]] | None) -> list[dict[str, int]]:
        out = []
        for c in containers or []:
            res = c.get("resources") or {}
            # Extended resources may be given as limits only; requests then default to them.
            merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
            out.append({r: quantity(merged.get(r)) for r in resources()})
        return out

    main, init = of(spec.get("containers")), of(spec.get("initContainers"))
    return {r: max(sum(c[r] for c in main), max((c[r] for c in init), default=0)) for r in resources()}


@dataclass
class Usage:
    """What is already taken on one node."""

    requested: dict[str, int] = field(default_factory=lambda: {r: 0 for r in resources()})
    memstrata_pods: int = 0

    def add(self, use: PodUse) -> None:
        for r in resources():
            self.requested[r] += use.requests.get(r, 0)
        self.memstrata_pods += int(use.memstrata)


def usage_by_node(uses: Iterable[PodUse]) -> dict[str, Usage]:
    """Sum pod uses per node; a pod seen twice (the watch and an in-flight creation) counts once."""
    seen: set[str] = set()
    out: dict[str, Usage] = {}
    for use in uses:
        if use.key in seen:
            continue
        seen.add(use.key)
        out.setdefault(use.node, Usage()).add(use)
    return out


def free_now(node: NodeView, usage: Usage | None) -> dict[str, int]:
    taken = usage.requested if usage else {}
    return {r: node.allocatable.get(r, 0) - taken.get(r, 0) for r in resources()}
