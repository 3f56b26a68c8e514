"""The strata a node may have, each described once: the one list every other part of memstrata iterates.

A stratum is where a job's bytes may live (GPU HBM, local DRAM, CXL-attached memory, raw NVMe). Its
descriptor says everything the rest of the code needs to know about it: its name, its default bandwidth, which
categories of model state it may hold and in what order the planner fills it, the extended resource a pod
requests for it, the inventory field that lists it, and the runtime façade that drives it. The planner, the
node inventory's rendering, the node agent's device plugins, the operator's memory request and the swap layer
all read `registry()`; adding a stratum is adding a descriptor here (and, where it needs one, a device-plugin
resource object in memstrata.nodeagent.devices and a capacity rule in memstrata.plan.capacity).
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import Field

from memstrata.api.base import ApiModel
from memstrata.api.units import GiB

__all__ = ["REGISTRY", "RESOURCE_CXL_GIB", "RESOURCE_GPU", "RESOURCE_NVME", "RESOURCE_PREFIX", "Bandwidth",
           "Stratum", "default_bandwidth", "names", "preferred_strata", "registry", "stratum", "titles",
           "with_resource"]

# The API group of memstrata's extended resources (its labels and annotations too: memstrata.api.inventory).
RESOURCE_PREFIX = "memstrata.dev"
RESOURCE_NVME = f"{RESOURCE_PREFIX}/nvme-ns"
RESOURCE_CXL_GIB = f"{RESOURCE_PREFIX}/cxl-gib"
RESOURCE_GPU = "nvidia.com/gpu"


class Bandwidth(ApiModel):
    """Sustained bytes/s of one stratum. Defaults are public datasheet figures, one per stratum below."""

    read: float = Field(gt=0)
    write: float = Field(gt=0)


class _Gpu(Protocol):
    @property
    def hbm_bytes(self) -> int: ...


class _Namespace(Protocol):
    @property
    def size_bytes(self) -> int: ...


class _CxlNode(Protocol):
    @property
    def memory_bytes(self) -> int: ...


class NodeInventory(Protocol):
    """What a descriptor reads of a node (memstrata.api.inventory.NodeInventory has it all): typed here, so that
    the inventory, which takes its bandwidth defaults from this registry, is not imported back."""

    @property
    def gpus(self) -> Sequence[_Gpu]: ...

    @property
    def free_namespaces(self) -> Sequence[_Namespace]: ...

    @property
    def cxl_nodes(self) -> Sequence[_CxlNode]: ...

    @property
    def dram_bytes(self) -> int: ...

    @property
    def cxl_bytes(self) -> int: ...


@dataclass(frozen=True)
class Stratum:
    """One stratum: what the planner, the node agent, the operator and the runtime need to know of it."""

    name: str  # the key in a Plan (Allocation.stratum, StratumUse.stratum, rank_bytes) and in bandwidth maps
    title: str  # for people: table headers, shortfall messages
    bandwidth: Bandwidth  # the default when the inventory does not say
    # Model-state categories (memstrata.plan.accounting) it may hold, and its rank among the strata that may
    # hold one: a category fills the strata that may hold it lowest `preference` first. CXL ranks before DRAM
    # so that data only ever moved by DMA leaves DRAM to the optimizer's operands (arXiv 2507.03305).
    holds: frozenset[str]
    preference: int
    inventory_field: str  # the NodeInventory field that lists it
    facade: str  # the runtime module that drives it (documentation; operator code never imports runtime)
    node_bytes: Callable[[NodeInventory], int]  # what a node has of it, before any policy
    resource: str | None = None  # the extended resource a pod requests for it (None: ordinary memory)
    # How many units of `resource` the node has; memstrata's node agent publishes and serves it when `served`.
    units: Callable[[NodeInventory], int] | None = None
    served: bool = False
    unit_bytes: int = 0  # bytes one unit of `resource` holds, where a plan requests it by bytes (0: by device)
    addressable: bool = True  # loads and stores reach it (False: block I/O, like NVMe)
    host_memory: bool = False  # its pages are charged to the container's memory cgroup


def _gpu_hbm(inventory: NodeInventory) -> int:
    return sum(g.hbm_bytes for g in inventory.gpus)


def _free_namespace_bytes(inventory: NodeInventory) -> int:
    return sum(ns.size_bytes for ns in inventory.free_namespaces)


def _cxl_gib(inventory: NodeInventory) -> int:
    # Whole GiB per CXL node, as the device plugin offers them: 2 x 1.5 GiB is 2, not 3.
    return sum(c.memory_bytes // GiB for c in inventory.cxl_nodes)


STATE = frozenset({"gradients", "checkpoints", "master", "optimizer", "weights"})

# In order of speed, fastest first: the order of a plan's strata and of its table's columns.
REGISTRY: tuple[Stratum, ...] = (
    # HBM3 on an H100 SXM: ~3.3 TB/s; only the working set lives there.
    Stratum(name="hbm", title="HBM", bandwidth=Bandwidth(read=3.0e12, write=3.0e12), holds=frozenset(),
            preference=0, inventory_field="gpus", facade="torch.cuda", node_bytes=_gpu_hbm,
            resource=RESOURCE_GPU, units=lambda inv: len(inv.gpus)),
    # One socket of DDR5, what a single rank's CPU optimizer sees.
    Stratum(name="dram", title="DRAM", bandwidth=Bandwidth(read=100e9, write=100e9), holds=STATE, preference=2,
            inventory_field="numa_nodes", facade="memstrata.runtime.strata.numa",
            node_bytes=lambda inv: inv.dram_bytes, host_memory=True),
    # A CXL x8 expander: ~31.5 GB/s per direction before protocol overhead.
    Stratum(name="cxl", title="CXL", bandwidth=Bandwidth(read=25e9, write=25e9),
            holds=frozenset({"checkpoints", "weights"}), preference=1, inventory_field="cxl_nodes",
            facade="memstrata.runtime.strata.numa", node_bytes=lambda inv: inv.cxl_bytes,
            resource=RESOURCE_CXL_GIB, units=_cxl_gib, served=True, unit_bytes=GiB, host_memory=True),
    # One PCIe Gen4 NVMe namespace: ~6.5 / 3.5 GB/s sequential.
    Stratum(name="nvme", title="NVMe", bandwidth=Bandwidth(read=6.5e9, write=3.5e9),
            holds=frozenset({"master", "optimizer", "weights"}), preference=3, inventory_field="nvme_namespaces",
            facade="memstrata.runtime.strata.nvme", node_bytes=_free_namespace_bytes, resource=RESOURCE_NVME,
            units=lambda inv: len(inv.free_namespaces), served=True, addressable=False),
)


def registry() -> tuple[Stratum, ...]:
    """Every stratum, fastest first. Read at call time (never copied at import), so that it is the one list."""
    return REGISTRY


def names() -> tuple[str, ...]:
    return tuple(s.name for s in REGISTRY)


def titles() -> dict[str, str]:
    """name -> title, for people."""
    return {s.name: s.title for s in REGISTRY}


def stratum(name: str) -> Stratum:
    """The descriptor of `name`; KeyError naming the known ones for any other."""
    for s in REGISTRY:
        if s.name == name:
            return s
    raise KeyError(f"no stratum {name!r}; known: {', '.join(names())}")


def with_resource(resource: str) -> Stratum:
    """The stratum a pod requests with `resource`; KeyError for any other."""
    for s in REGISTRY:
        if s.resource == resource:
            return s
    raise KeyError(f"no stratum is requested as {resource!r}")


def default_bandwidth() -> dict[str, Bandwidth]:
    return {s.name: s.bandwidth for s in REGISTRY}


def preferred_strata(category: str) -> tuple[str, ...]:
    """The strata that may hold `category`, in the order the planner fills them."""
    return tuple(s.name for s in sorted((s for s in REGISTRY if category in s.holds), key=lambda s: s.preference))
