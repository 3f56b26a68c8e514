"""One kubelet device plugin (v1beta1 gRPC) per memstrata resource.

Reads in lifecycle order: start (serve on our socket) → register (tell the
kubelet on kubelet.sock) → ListAndWatch (the whole list first, again on
every change published) → GetPreferredAllocation → Allocate → stop. What is
offered, preferred and granted is decided by the server's resource object
(`memstrata.nodeagent.devices.Resource`); this module is only the wire.
Restarts (kubelet restart, SIGHUP) are the caller's event loop: it stops a
server and starts a new one.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc

from memstrata.nodeagent.devices import AllocationError, PluginDevice, Resource, checked, merge
from memstrata.nodeagent.metrics import AgentMetrics
from memstrata.nodeagent.proto import deviceplugin_pb2 as pb
from memstrata.nodeagent.proto import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
# How often a ListAndWatch stream checks that its kubelet is still there; a
# dead kubelet's stream must end so its worker thread is freed.
STREAM_POLL_S = 0.5


class RegistrationError(RuntimeError):
    """The kubelet refused the plugin or could not be reached on kubelet.sock."""


def socket_name(resource: str) -> str:
    """memstrata.dev/nvme-ns -> memstrata-nvme-ns.sock (one flat file in the plugin dir)."""
    return resource.replace(".dev/", "-").replace("/", "-") + ".sock"


# Why a device may not be granted right now (read from the device itself), None when it may.
Vet = Callable[[PluginDevice], str | None]


class DevicePluginServer(pb_grpc.DevicePluginServicer):
    """Serves one resource's devices (`manager` decides what is listed, granted and preferred). The
    constructor does no I/O; start() does.

    `vet`, when given, is asked about every device of an Allocate: the list the kubelet acted on
    may be older than what happened since (a job killed a moment ago left its data on a namespace
    the last scan still saw in use), and a device it refuses is never handed to a container."""

    def __init__(self, manager: Resource, plugin_dir: Path, vet: Vet | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        self.manager = manager
        self.metrics = metrics or AgentMetrics()
        self.resource = manager.name
        self.plugin_dir = Path(plugin_dir)
        self._vet = vet
        self.endpoint = socket_name(self.resource)
        self._server: grpc.Server | None = None
        self._changed = threading.Condition()
        self._devices: list[PluginDevice] = []
        self._version = 0
        self._stopped = False

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.endpoint

    @property
    def devices(self) -> list[PluginDevice]:
        with self._changed:
            return list(self._devices)

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        # A socket left by an earlier run would make bind fail with EADDRINUSE.
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=self.endpoint))
        pb_grpc.add_DevicePluginServicer_to_server(self, server)
        if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise RegistrationError(f"{self.resource}: cannot listen on {self.socket_path}")
        server.start()
        self._server = server
        log.info("%s: serving on %s", self.resource, self.socket_path)

    def register(self, timeout: float = 5.0) -> None:
        kubelet = self.plugin_dir / KUBELET_SOCKET
        request = pb.RegisterRequest(version=API_VERSION, endpoint=self.endpoint, resource_name=self.resource,
                                     options=self._options())
        try:
            with grpc.insecure_channel(f"unix:{kubelet}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            self.metrics.registrations.labels(self.resource, "error").inc()
            raise RegistrationError(f"{self.resource}: registration with {kubelet} failed: "
                                    f"{exc.code().name}: {exc.details()}") from exc
        self.metrics.registrations.labels(self.resource, "ok").inc()
        log.info("%s: registered with %s", self.resource, kubelet)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def publish(self, available: list[PluginDevice]) -> bool:
        """Make `available` the healthy set; wakes every ListAndWatch when anything changed."""
        with self._changed:
            merged = merge(self._devices, available)
            if merged == self._devices:
                return False
            self._devices = merged
            self._version += 1
            self._changed.notify_all()
        log.info("%s: %d devices, %d healthy", self.resource, len(merged), sum(d.healthy for d in merged))
        return True

    # --- the DevicePlugin service ---------------------------------------------

    def _options(self) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False,
                                      get_preferred_allocation_available=self.manager.has_preference)

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return self._options()

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        sent = -1
        while True:
            with self._changed:
                while self._version == sent and not self._stopped and context.is_active():
                    self._changed.wait(STREAM_POLL_S)
                if self._stopped or not context.is_active():
                    return
                sent, devices = self._version, list(self._devices)
            yield pb.ListAndWatchResponse(devices=[_device_pb(d) for d in devices])

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> pb.PreferredAllocationResponse:
        devices = self.devices
        return pb.PreferredAllocationResponse(container_responses=[
            pb.ContainerPreferredAllocationResponse(deviceIDs=self.manager.preferred(
                list(c.available_deviceIDs), list(c.must_include_deviceIDs), c.allocation_size, devices))
            for c in request.container_requests])

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        devices = self.devices
        responses = []
        for container in request.container_requests:
            try:
                given = self.manager.grant(checked(self.resource, list(container.devices_ids), devices))
                self._check(list(container.devices_ids), devices)
            except AllocationError as exc:
                log.warning("refusing Allocate: %s", exc)
                self.metrics.allocations.labels(self.resource, "refused").inc()
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            responses.append(pb.ContainerAllocateResponse(
                envs=given.envs,
                devices=[pb.DeviceSpec(container_path=p, host_path=p, permissions="rw") for p in given.device_paths],
            ))
        self.metrics.allocations.labels(self.resource, "granted").inc()
        return pb.AllocateResponse(container_responses=responses)

    def _check(self, ids: list[str], devices: list[PluginDevice]) -> None:
        if self._vet is None:
            return
        by_id = {d.id: d for d in devices}
        refused = {i: why for i in ids if (why := self._vet(by_id[i])) is not None}
        if refused:
            raise AllocationError(f"{self.resource}: devices not available now: "
                                  + "; ".join(f"{i} ({by_id[i].dev_path or i}): {why}" for i, why in refused.items()))

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _device_pb(d: PluginDevice) -> pb.Device:
    topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)]) if d.numa_node is not None else None
    return pb.Device(ID=d.id, health=d.health, topology=topology)


def socket_identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when the kubelet re-creates its socket (None while it is absent)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)
