"""What the device plugin offers, and what a container gets: pure functions of the inventory.

One resource object per extended resource, as NVIDIA's device plugin has one ResourceManager per resource: its
name, the devices it lists from the inventory (and their health), what it grants a container and which devices
it prefers. The node agent serves one plugin per stratum that memstrata.api.strata marks `served`, each with
the object `manager(stratum)` gives it; a stratum with no object of its own here is offered as counted units.
Today's two (names from memstrata.api.strata):

- `memstrata.dev/nvme-ns`: one device per free NVMe namespace, on its
  controller's NUMA node; Unhealthy while it holds a finished job's data,
  until the node agent has scrubbed it (memstrata.nodeagent.scrubber). Its ID
  is the namespace's WWID when the kernel reports one, so that a renamed
  namespace (nvme0n1 and nvme1n1 swap after a reboot) keeps its identity in the
  kubelet's checkpoint; else its name.
  A container gets the /dev node (DeviceSpec) and MEMSTRATA_NVME_DEVICES.
  The plugin prefers the namespaces the planner counted (`preferred`).
- `memstrata.dev/cxl-gib`: one device per whole GiB of each CXL NUMA node,
  on that node. A container gets MEMSTRATA_CXL_NODES, the nodes its units
  lie on, to bind its CXL arenas to.

A device once offered stays in the list for the agent's lifetime: when its
namespace vanishes or stops being free it turns Unhealthy (so the kubelet
stops counting it) instead of disappearing, which the kubelet would treat as
a silent capacity drop.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from memstrata.api import strata
from memstrata.api.inventory import ENV_CXL_NODES, ENV_NVME_DEVICES, NodeInventory
from memstrata.api.namespacechoice import NamespaceCandidate, choose_namespaces
from memstrata.api.strata import Stratum
from memstrata.api.units import GiB

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class PluginDevice:
    id: str
    healthy: bool
    numa_node: int | None
    dev_path: str = ""  # nvme-ns: the namespace's /dev node
    cxl_node: int | None = None  # cxl-gib: the NUMA node the GiB lies on
    name: str = ""  # nvme-ns: the namespace's block device name, and its size: what the planner ranks by
    size_bytes: int = 0

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


@dataclass(frozen=True)
class ContainerGrant:
    """What one container is given: env, and device nodes (host path = container path)."""

    envs: dict[str, str]
    device_paths: tuple[str, ...] = ()


def runtime_env(dev_paths: Sequence[str], cxl_nodes: Collection[int]) -> dict[str, str]:
    """What the runtime reads of the devices a container was given: its namespaces' /dev nodes, in order, and the
    CXL NUMA nodes, sorted; a variable only for what it got. The device plugin's grants and DRA's CDI specs
    (memstrata.nodeagent.draslice.claim_env) both set exactly this."""
    env = {ENV_NVME_DEVICES: ",".join(dev_paths)} if dev_paths else {}
    if cxl_nodes:
        env[ENV_CXL_NODES] = ",".join(map(str, sorted(set(cxl_nodes))))
    return env


class AllocationError(ValueError):
    """An Allocate the plugin must refuse; the kubelet fails the pod with this message."""


def nvme_devices(inventory: NodeInventory, scrubbing: Collection[str] = ()) -> list[PluginDevice]:
    """One device per free namespace; Unhealthy when its name is in `scrubbing` (a finished job's data is
    on it: no pod may get it before the scrub), Healthy otherwise."""
    return [PluginDevice(id=ns.wwid or ns.name, healthy=ns.name not in scrubbing, numa_node=ns.numa_node,
                         dev_path=ns.dev_path, name=ns.name, size_bytes=ns.size_bytes)
            for ns in inventory.free_namespaces]


def cxl_devices(inventory: NodeInventory) -> list[PluginDevice]:
    # Whole GiB per node: a unit cannot straddle two nodes, so a node's tail
    # below 1 GiB is not offered (render_node's label counts the summed bytes).
    return [PluginDevice(id=f"cxl-node{c.numa_node}-gib{i}", healthy=True, numa_node=c.numa_node,
                         cxl_node=c.numa_node)
            for c in inventory.cxl_nodes for i in range(c.memory_bytes // GiB)]


class Resource:
    """One extended resource a plugin serves; the base offers a stratum's units as anonymous devices, grants
    them with nothing to set in the container, and has no preference (the kubelet's choice stands)."""

    has_preference = False  # whether the kubelet must ask GetPreferredAllocation

    def __init__(self, stratum: Stratum) -> None:
        if stratum.resource is None:
            raise ValueError(f"stratum {stratum.name} has no extended resource to serve")
        self.stratum = stratum
        self.name: str = stratum.resource

    def devices(self, inventory: NodeInventory, scrubbing: Collection[str] = ()) -> list[PluginDevice]:
        """What the plugin lists now, each Healthy or not; `scrubbing`: namespaces holding a finished job's data."""
        units = self.stratum.units(inventory) if self.stratum.units is not None else 0
        return [PluginDevice(id=f"{self.stratum.name}-{i}", healthy=True, numa_node=None) for i in range(units)]

    def grant(self, chosen: Sequence[PluginDevice]) -> ContainerGrant:
        """What a container given `chosen` (known, healthy) gets."""
        return ContainerGrant(envs={})

    def preferred(self, available: list[str], must_include: list[str], size: int,
                  devices: list[PluginDevice]) -> list[str]:
        return list(must_include)


class NvmeNamespaces(Resource):
    """`memstrata.dev/nvme-ns`: raw namespaces; the /dev node and MEMSTRATA_NVME_DEVICES; the planner's pick."""

    has_preference = True  # the kubelet must grant the namespaces the plan counted

    def devices(self, inventory: NodeInventory, scrubbing: Collection[str] = ()) -> list[PluginDevice]:
        return nvme_devices(inventory, scrubbing)

    def grant(self, chosen: Sequence[PluginDevice]) -> ContainerGrant:
        paths = tuple(d.dev_path for d in chosen)
        return ContainerGrant(envs=runtime_env(paths, ()), device_paths=paths)

    def preferred(self, available: list[str], must_include: list[str], size: int,
                  devices: list[PluginDevice]) -> list[str]:
        """Of the kubelet's `available` IDs, the `size` namespaces the planner would choose
        (memstrata.api.namespacechoice), always keeping `must_include`."""
        offered = set(available)
        known = [NamespaceCandidate(id=d.id, name=d.name or d.id, size_bytes=d.size_bytes)
                 for d in devices if d.id in offered and d.healthy]
        return choose_namespaces(known, size, must_include)


class CxlGib(Resource):
    """`memstrata.dev/cxl-gib`: whole GiB of CXL NUMA nodes; MEMSTRATA_CXL_NODES, the nodes its units lie on."""

    def devices(self, inventory: NodeInventory, scrubbing: Collection[str] = ()) -> list[PluginDevice]:
        return cxl_devices(inventory)

    def grant(self, chosen: Sequence[PluginDevice]) -> ContainerGrant:
        return ContainerGrant(envs=runtime_env((), [d.cxl_node for d in chosen if d.cxl_node is not None]))


# The strata whose devices are more than counted units, by stratum name.
KINDS: dict[str, type[Resource]] = {"nvme": NvmeNamespaces, "cxl": CxlGib}


def manager(stratum: Stratum) -> Resource:
    return KINDS.get(stratum.name, Resource)(stratum)


def resources() -> list[Resource]:
    """One object per resource the node agent serves, in the registry's order."""
    return [manager(s) for s in strata.registry() if s.served and s.resource is not None]


def resource(name: str) -> Resource:
    """The object serving extended resource `name`; AllocationError for one no plugin serves."""
    try:
        return manager(strata.with_resource(name))
    except (KeyError, ValueError):
        raise AllocationError(f"unknown resource {name}") from None


def offered(name: str, inventory: NodeInventory, scrubbing: Collection[str] = ()) -> list[PluginDevice]:
    """What the plugin for resource `name` lists; `scrubbing` as for nvme_devices."""
    return resource(name).devices(inventory, scrubbing)


def merge(previous: list[PluginDevice], current: list[PluginDevice]) -> list[PluginDevice]:
    """The list to advertise: every device now available (healthy), plus every device
    advertised before that is no longer available (unhealthy), in a stable order."""
    now = {d.id: d for d in current}
    merged = [now.pop(d.id) if d.id in now else replace(d, healthy=False) for d in previous]
    return merged + list(now.values())


def checked(name: str, ids: list[str], devices: list[PluginDevice]) -> list[PluginDevice]:
    """The devices of one container's IDs, each known and healthy in the current list of resource `name`."""
    by_id = {d.id: d for d in devices}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise AllocationError(f"{name}: unknown device IDs {unknown}")
    # The kubelet may act on a list older than our last health change; a
    # namespace that gained a filesystem since must not reach a container.
    sick = [i for i in ids if not by_id[i].healthy]
    if sick:
        raise AllocationError(f"{name}: devices no longer available (unhealthy): {sick}")
    return [by_id[i] for i in ids]


def grant(name: str, ids: list[str], devices: list[PluginDevice]) -> ContainerGrant:
    """The grant for one container's device IDs, checked against the current list."""
    return resource(name).grant(checked(name, ids, devices))


def preferred(name: str, available: list[str], must_include: list[str], size: int,
              devices: list[PluginDevice]) -> list[str]:
    """GetPreferredAllocation for one container of resource `name`: its object's preference, if it has one;
    for any other the kubelet's own choice stands (`must_include` alone is returned, which the kubelet tops
    up)."""
    return resource(name).preferred(available, must_include, size, devices)
