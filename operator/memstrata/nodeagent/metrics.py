"""The node agent's Prometheus metrics: the devices it offers, its scrubs, its kubelet registrations, its scans.

Counters and histograms are bumped where the work happens; the device gauges are read at scrape time from
what the device plugins publish to the kubelet, so a scrape shows exactly what the kubelet was told. Each
AgentMetrics has a registry of its own.
"""
from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from memstrata.node.loopscan import LOOP_NAME

if TYPE_CHECKING:
    from memstrata.nodeagent.devices import PluginDevice

PREFIX = "memstrata_nodeagent"
SCAN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A scrub writes a namespace's header and the extents a job used: a second on a loop file, minutes on a drive.
SCRUB_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
Offered = Callable[[], Iterable[tuple[str, "PluginDevice"]]]


def device_kind(resource: str, device: PluginDevice) -> str:
    """nvme, loop (a test cluster's loop device standing in for one) or the stratum's resource name's tail."""
    if device.name:
        return "loop" if LOOP_NAME.match(device.name) else "nvme"
    # memstrata.dev/cxl-gib -> cxl-gib; a DRA DeviceClass, cxl.memstrata.dev -> cxl
    return resource.rsplit("/", 1)[-1].split(".", 1)[0]


class _Devices(Collector):
    def __init__(self) -> None:
        self.offered: Offered = lambda: ()
        self.scrubbing: Callable[[], int] = lambda: 0

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(f"{PREFIX}_devices", "Devices the device plugins list to the kubelet (or, under "
                                   "DRA, the node's ResourceSlice offers, by DeviceClass), by resource, kind and "
                                   "health", labels=["resource", "kind", "health"])
        counts = Tally((resource, device_kind(resource, d), d.health) for resource, d in self.offered())
        for labels, n in sorted(counts.items()):
            family.add_metric(list(labels), n)
        yield family
        yield GaugeMetricFamily(f"{PREFIX}_scrubs_running", "Namespaces being scrubbed now", value=self.scrubbing())


class AgentMetrics:
    """The node agent's instruments, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.devices = _Devices()
        r.register(self.devices)
        self.scans = Counter(f"{PREFIX}_discovery_scans", "Discovery scans by result (ok, or error: the previous "
                             "inventory is kept)", ["result"], registry=r)
        self.scan_seconds = Histogram(f"{PREFIX}_discovery_duration_seconds", "Time per discovery scan",
                                      buckets=SCAN_BUCKETS, registry=r)
        self.scrubs = Counter(f"{PREFIX}_scrubs", "Scrubs of namespaces a job left dirty, by result (clean, "
                              "failed: retried later, the namespace Unhealthy meanwhile)", ["result"], registry=r)
        self.scrub_seconds = Histogram(f"{PREFIX}_scrub_duration_seconds", "Time per finished scrub",
                                       buckets=SCRUB_BUCKETS, registry=r)
        self.registrations = Counter(f"{PREFIX}_kubelet_registrations", "Device plugin registrations with the "
                                     "kubelet, by resource and result", ["resource", "result"], registry=r)
        self.allocations = Counter(f"{PREFIX}_allocations", "Allocate calls from the kubelet, by resource and "
                                   "result (granted, or refused: a device not safe to hand over)",
                                   ["resource", "result"], registry=r)
