"""What the DRA driver publishes and what a prepared claim gives a container: pure functions of the inventory.

The same discovery as the device plugin (memstrata.node.discovery), seen by the scheduler in more detail:
a device per free namespace with its size, controller and NUMA node, a device per CXL memory node with
its bytes. A namespace holding a finished job's data (being scrubbed) or no longer free leaves the slice
until it is clean again: the scheduler cannot allocate what it does not see, and a claim that already
holds a device keeps it (allocations live in the claims, not in the slice). Names from memstrata.api.dra.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memstrata.api import dra
from memstrata.api.inventory import CxlNode, NodeInventory, NvmeNamespace
from memstrata.nodeagent.devices import runtime_env


@dataclass(frozen=True)
class DraDevice:
    """One published device and what giving it to a container means."""

    name: str
    kind: str  # dra.KIND_NVME or dra.KIND_CXL
    namespace: str = ""  # nvme-ns: the block device's name (the scrubber's key)
    dev_path: str = ""  # nvme-ns: its /dev node
    cxl_node: int | None = None  # cxl: the NUMA node


def _string(value: str) -> dict[str, str]:
    return {"string": value[:dra.MAX_STRING]}


def namespace_entry(ns: NvmeNamespace, inventory: NodeInventory) -> dict[str, Any]:
    """The slice's device for free namespace `ns`."""
    model = next((c.model for c in inventory.nvme_controllers if c.name == ns.controller), "")
    attrs: dict[str, Any] = {"kind": _string(dra.KIND_NVME), "namespace": _string(ns.name),
                             "controller": _string(ns.controller or ("loop" if ns.kind == "loop" else "")),
                             "model": _string(model), "blockSize": {"int": ns.logical_block_size},
                             "loop": {"bool": ns.kind == "loop"}}
    if ns.numa_node is not None:
        attrs["numaNode"] = {"int": ns.numa_node}
    if ns.wwid and len(ns.wwid) <= dra.MAX_STRING:  # longer ones are in the name's hash only
        attrs["wwid"] = _string(ns.wwid)
    return {"name": dra.namespace_device_name(ns.name, ns.wwid), "attributes": attrs,
            "capacity": {dra.SIZE: {"value": str(ns.size_bytes)}}}


def cxl_entry(node: CxlNode) -> dict[str, Any]:
    """The slice's device for CXL memory node `node`: shared by claims up to its bytes, in 2 MiB steps."""
    attrs: dict[str, Any] = {"kind": _string(dra.KIND_CXL), "numaNode": {"int": node.numa_node},
                             "expanders": _string(",".join(m.name for m in node.memdevs))}
    if node.region:
        attrs["region"] = _string(node.region)
    step = str(dra.CXL_STEP_BYTES)
    capacity: dict[str, Any] = {"value": str(node.memory_bytes)}
    if node.memory_bytes >= 2 * dra.CXL_STEP_BYTES:  # the API wants min + step within the capacity
        capacity["requestPolicy"] = {"default": step, "validRange": {"min": step, "step": step}}
    return {"name": dra.cxl_device_name(node.numa_node), "attributes": attrs, "allowMultipleAllocations": True,
            "capacity": {dra.MEMORY: capacity}}


def _offered_namespaces(inventory: NodeInventory, scrubbing: Collection[str]) -> list[NvmeNamespace]:
    return [ns for ns in inventory.free_namespaces if ns.name not in scrubbing]


def offered(inventory: NodeInventory, scrubbing: Collection[str] = ()) -> list[DraDevice]:
    """Every device a claim may get now: free namespaces not being scrubbed, and every CXL node."""
    namespaces = [DraDevice(name=dra.namespace_device_name(ns.name, ns.wwid), kind=dra.KIND_NVME,
                            namespace=ns.name, dev_path=ns.dev_path)
                  for ns in _offered_namespaces(inventory, scrubbing)]
    return namespaces + [DraDevice(name=dra.cxl_device_name(c.numa_node), kind=dra.KIND_CXL, cxl_node=c.numa_node)
                         for c in inventory.cxl_nodes]


def slice_spec(inventory: NodeInventory, node_name: str, generation: int,
               scrubbing: Collection[str] = ()) -> dict[str, Any]:
    """The spec of the node's one ResourceSlice (pool = the node, one slice in it)."""
    devices = [namespace_entry(ns, inventory) for ns in _offered_namespaces(inventory, scrubbing)]
    devices += [cxl_entry(c) for c in inventory.cxl_nodes]
    return {"driver": dra.DRIVER, "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": devices}


class PrepareError(ValueError):
    """A claim's allocation this node cannot honour; the kubelet fails the pod with the message."""


def allocated(claim: Mapping[str, Any], node_name: str) -> list[dict[str, Any]]:
    """The results of `claim`'s allocation that name this driver's pool on this node."""
    meta = claim.get("metadata") or {}
    where = f"ResourceClaim {meta.get('namespace')}/{meta.get('name')}"
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise PrepareError(f"{where} is not allocated")
    results = [r for r in (allocation.get("devices") or {}).get("results") or []
               if r.get("driver") == dra.DRIVER]
    foreign = sorted({r.get("pool") for r in results if r.get("pool") != node_name})
    if foreign:
        raise PrepareError(f"{where} was allocated devices of pool(s) {foreign}, not of this node {node_name!r}")
    return results


def resolve(results: Sequence[Mapping[str, Any]], devices: Sequence[DraDevice], where: str) -> list[DraDevice]:
    """The devices `results` name, each still offered; refuses, naming them, the ones that are not (scrubbing,
    in use, gone, renamed)."""
    by_name = {d.name: d for d in devices}
    missing = [r.get("device") for r in results if r.get("device") not in by_name]
    if missing:
        raise PrepareError(f"{where}: devices {missing} are not available on this node now (in use, being "
                           "scrubbed or gone); the claim must be allocated again")
    return [by_name[r["device"]] for r in results]


def claim_env(chosen: Sequence[DraDevice]) -> list[str]:
    """The environment a container of one claim gets, as CDI writes it: what the device plugin's grant sets
    (memstrata.nodeagent.devices.runtime_env)."""
    env = runtime_env([d.dev_path for d in chosen if d.kind == dra.KIND_NVME],
                      [d.cxl_node for d in chosen if d.cxl_node is not None])
    return [f"{k}={v}" for k, v in env.items()]
