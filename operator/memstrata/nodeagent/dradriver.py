"""The node agent's DRA mode (`--device-api dra`): the kubelet plugin and the node's ResourceSlice, kept in step.

Each rescan gives both the same list (memstrata.nodeagent.draslice.offered): what the slice shows is
exactly what prepare may hand out. Excluded are the namespaces holding a finished job's data (being
scrubbed) and those a process holds with a job's header on them (in use: a job of this node, whether
its claim came through DRA or, while a node changes modes, through the device plugin).
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Collection
from functools import partial

from memstrata.api import dra
from memstrata.api.inventory import NodeInventory
from memstrata.nodeagent.devices import PluginDevice
from memstrata.nodeagent.draplugin import DraPlugin, Vet
from memstrata.nodeagent.draslice import offered, slice_spec
from memstrata.nodeagent.drapublish import SlicePublisher
from memstrata.nodeagent.metrics import AgentMetrics

log = logging.getLogger(__name__)


class DraDriver:
    """The plugin (gRPC) and the publisher (API server) of one node. The constructor does no I/O."""

    def __init__(self, args: argparse.Namespace, vet: Vet, on_unprepare: Callable[[list[str]], None],
                 metrics: AgentMetrics, rescan: Callable[[], None] = lambda: None) -> None:
        self.node_name = args.node_name
        self.publisher = SlicePublisher(args.node_name, args.kubeconfig)
        self.plugin = DraPlugin(args.node_name, self.publisher.claim, kubelet_dir=args.kubelet_dir,
                                cdi_dir=args.cdi_dir, device_gid=args.training_device_gid, vet=vet,
                                on_unprepare=on_unprepare, on_registered=lambda: self._registered(rescan),
                                metrics=metrics)

    def _registered(self, rescan: Callable[[], None]) -> None:
        # A kubelet that has just started deletes its node's slices: read ours back now, not in VERIFY_S.
        self.publisher.forget()
        rescan()

    def start(self) -> None:
        self.plugin.start()

    def listed(self) -> list[tuple[str, PluginDevice]]:
        """What the slice offers, as the device gauge counts it: by DeviceClass, every device healthy (a device
        that is not leaves the slice)."""
        return [(dra.NVME_CLASS, PluginDevice(id=d.name, healthy=True, numa_node=None, name=d.namespace))
                if d.kind == dra.KIND_NVME else
                (dra.CXL_CLASS, PluginDevice(id=d.name, healthy=True, numa_node=d.cxl_node, cxl_node=d.cxl_node))
                for d in self.plugin.offered]

    def stop(self) -> None:
        self.plugin.stop()

    def rescan(self, inventory: NodeInventory, excluded: Collection[str]) -> None:
        """Offer what is free now, to prepare first (it may only shrink what the scheduler saw) and then in the
        slice; an API server away is logged and retried at the next scan."""
        self.plugin.offer(offered(inventory, excluded))
        try:
            self.publisher.publish(partial(slice_spec, inventory, self.node_name, scrubbing=excluded))
        except Exception as exc:
            log.warning("could not publish the ResourceSlice of node %s (will retry): %s", self.node_name, exc)
