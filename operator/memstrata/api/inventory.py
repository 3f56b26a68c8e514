"""The node inventory and the one place that names its Kubernetes form.

The node agent publishes `render_node(inventory)` and the operator reads it
back with `read_node(node)`; both sides use these constants, so they cannot
disagree on a label, annotation or resource name.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Mapping

from pydantic import Field, ValidationError

from memstrata.api import strata
from memstrata.api.base import ApiModel
# The strata's resource names and bandwidth are their descriptors' (memstrata.api.strata), named here too.
from memstrata.api.strata import RESOURCE_CXL_GIB as RESOURCE_CXL_GIB
from memstrata.api.strata import RESOURCE_GPU as RESOURCE_GPU
from memstrata.api.strata import RESOURCE_NVME as RESOURCE_NVME
from memstrata.api.strata import RESOURCE_PREFIX
from memstrata.api.strata import Bandwidth as Bandwidth
from memstrata.api.units import GiB, Bytes

PREFIX = RESOURCE_PREFIX
LABEL_MANAGED = f"{PREFIX}/managed"
LABEL_CXL = f"{PREFIX}/cxl"
LABEL_CXL_GIB = f"{PREFIX}/cxl-capacity-gib"
LABEL_CXL_NODES = f"{PREFIX}/cxl-node-count"
LABEL_NVME_FREE = f"{PREFIX}/nvme-free-count"
LABEL_NVME_FREE_GIB = f"{PREFIX}/nvme-free-gib"
LABEL_DRAM_GIB = f"{PREFIX}/dram-gib"
# Set ("true") only on a node whose agent advertises loop devices as namespaces (--loop-namespaces, test and
# development clusters), so that `kubectl get nodes -L` tells them from NVMe; absent everywhere else.
LABEL_LOOP_NAMESPACES = f"{PREFIX}/loop-namespaces"
# Labels render_node sets only on some nodes: the node agent's patch removes them where it no longer does.
OPTIONAL_LABELS = (LABEL_LOOP_NAMESPACES,)
ANNOTATION_INVENTORY = f"{PREFIX}/inventory"
# The training container requests its plan's host memory too (operator.render.container_requests).
RESOURCE_MEMORY = "memory"
# Env the device plugin sets in a container (see the node agent).
ENV_NVME_DEVICES = "MEMSTRATA_NVME_DEVICES"
# A local run's scratch directory, presented as a namespace of this controller (memstrata.node.local): each
# rank makes its own files there, so one such "namespace" serves every rank of the node.
SCRATCH_CONTROLLER = "scratch-directory"
ENV_CXL_NODES = "MEMSTRATA_CXL_NODES"

NumaKind = Literal["dram", "cxl", "memory-only"]


class NumaNode(ApiModel):
    id: int = Field(ge=0)
    kind: NumaKind = "dram"
    cpus: list[int] = []
    memory_bytes: Bytes
    distances: list[int] = []
    tier: int | None = Field(None, description="Kernel memory tier (lower is faster), if known.")


class CxlMemdev(ApiModel):
    name: str
    serial: str | None = None
    ram_bytes: Bytes = 0


class CxlNode(ApiModel):
    """A CPU-less NUMA node backed by a CXL region."""

    numa_node: int = Field(ge=0)
    memory_bytes: Bytes
    region: str | None = None
    dax_device: str | None = None
    memdevs: list[CxlMemdev] = []


class NvmeController(ApiModel):
    name: str
    model: str = ""
    serial: str = ""
    firmware: str = ""
    transport: str = ""
    numa_node: int | None = None


NamespaceKind = Literal["nvme", "loop"]


class NvmeNamespace(ApiModel):
    name: str = Field(description="Block device name, e.g. nvme0n1 (loop3 for a loop device).")
    kind: NamespaceKind = Field("nvme", description=(
        "What the block device is: `nvme`, a namespace of an NVMe controller; `loop`, a loop device over a "
        "file on the node's own filesystem, advertised only when the node agent was started with "
        "--loop-namespaces (test and development clusters; it has no controller, NUMA node or WWID)."))
    controller: str = ""
    nsid: int = Field(1, ge=1)
    size_bytes: Bytes
    logical_block_size: int = Field(512, gt=0)
    wwid: str | None = None
    numa_node: int | None = None
    free: bool = Field(description="No partitions, mounts, holders or foreign signature: safe to hand to a job.")
    reason: str | None = Field(None, description="Why the namespace is not free.")

    @property
    def dev_path(self) -> str:
        return f"/dev/{self.name}"


class Gpu(ApiModel):
    index: int = Field(0, ge=0)
    name: str = ""
    hbm_bytes: Bytes


class NodeInventory(ApiModel):
    hostname: str = ""
    numa_nodes: list[NumaNode] = []
    cxl_nodes: list[CxlNode] = []
    nvme_controllers: list[NvmeController] = []
    nvme_namespaces: list[NvmeNamespace] = []
    gpus: list[Gpu] = []
    bandwidth: dict[str, Bandwidth] = Field(default_factory=strata.default_bandwidth)

    @property
    def dram_bytes(self) -> int:
        return sum(n.memory_bytes for n in self.numa_nodes if n.kind == "dram")

    @property
    def cxl_bytes(self) -> int:
        return sum(c.memory_bytes for c in self.cxl_nodes)

    @property
    def free_namespaces(self) -> list[NvmeNamespace]:
        return [ns for ns in self.nvme_namespaces if ns.free]

    def bw(self, stratum: str) -> Bandwidth:
        return self.bandwidth.get(stratum) or strata.stratum(stratum).bandwidth


class NodeNotManagedError(ValueError):
    """The Node carries no (or an unreadable) memstrata inventory annotation."""


def render_node(inventory: NodeInventory) -> dict[str, dict[str, str]]:
    """The labels, annotations and extended-resource capacity the node agent publishes."""
    free = inventory.free_namespaces
    capacity = resource_capacity(inventory)
    cxl_gib = int(capacity[RESOURCE_CXL_GIB])  # whole GiB per CXL node, as the device plugin offers them
    labels = {
        LABEL_MANAGED: "true",
        LABEL_CXL: "true" if inventory.cxl_nodes else "false",
        LABEL_CXL_GIB: str(cxl_gib),
        LABEL_CXL_NODES: str(len(inventory.cxl_nodes)),
        LABEL_NVME_FREE: str(len(free)),
        LABEL_NVME_FREE_GIB: str(sum(ns.size_bytes for ns in free) // GiB),
        LABEL_DRAM_GIB: str(inventory.dram_bytes // GiB),
    }
    if any(ns.kind == "loop" for ns in inventory.nvme_namespaces):
        labels[LABEL_LOOP_NAMESPACES] = "true"
    annotations = {ANNOTATION_INVENTORY: inventory.model_dump_json(by_alias=True, exclude_none=True)}
    return {"labels": labels, "annotations": annotations, "capacity": capacity}


def resource_capacity(inventory: NodeInventory) -> dict[str, str]:
    """The extended resources the node has, one per stratum that has a resource: those memstrata's node agent
    serves always (0 included, so that a node that lost its namespaces says so), the others (the GPUs, which
    NVIDIA's plugin serves) where the node has any."""
    capacity: dict[str, str] = {}
    for s in strata.registry():
        count = s.units(inventory) if s.units is not None else 0
        if s.resource is not None and (s.served or count):
            capacity[s.resource] = str(count)
    return capacity


def read_node(node: Mapping[str, Any]) -> NodeInventory:
    """The inventory a Node object (as a dict from the API) carries; the inverse of render_node."""
    meta = node.get("metadata") or {}
    name = meta.get("name", "<unnamed>")
    raw = (meta.get("annotations") or {}).get(ANNOTATION_INVENTORY)
    if raw is None:
        raise NodeNotManagedError(f"node {name}: no {ANNOTATION_INVENTORY} annotation (is the node agent running?)")
    try:
        return NodeInventory.model_validate(json.loads(raw))
    except (json.JSONDecodeError, ValidationError) as exc:
        first = str(exc).splitlines()[0]
        raise NodeNotManagedError(f"node {name}: unreadable {ANNOTATION_INVENTORY} annotation: {first}") from exc
