"""memstrata's DRA kubelet plugin (`dra.memstrata.dev`): registration and the DRA v1 gRPC service.

Reads in lifecycle order: start (serve the DRA service on the plugin's socket and the registration
service on a socket in the kubelet's plugins_registry directory; the kubelet's plugin watcher finds it,
asks GetInfo and reports back) → NodePrepareResources (a pod that claims our devices is about to
start) → NodeUnprepareResources (its containers are gone) → stop.

Prepare reads each claim from the API server, checks that every device allocated to it is still
offered (free, not being scrubbed) and, for a namespace, that no finished job's data is on it (the same
last look as the device plugin's Allocate), then writes the claim's CDI spec (memstrata.nodeagent.cdi).
A claim prepared before (its spec is on disk) is answered from it again without a second look: its own
job's data may be on it. Unprepare marks every namespace the claim had for a scrub (its pod may have
written anything, memstrata's header or not), removes the spec and asks the agent for a rescan, which
starts the scrub; until the scrub is done they are out of the slice and refused.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from memstrata.api import dra
from memstrata.nodeagent import cdi
from memstrata.nodeagent.draslice import DraDevice, PrepareError, allocated, resolve
from memstrata.nodeagent.metrics import AgentMetrics
from memstrata.nodeagent.proto import dra_pb2 as pb
from memstrata.nodeagent.proto import dra_pb2_grpc as pb_grpc
from memstrata.nodeagent.proto import pluginregistration_pb2 as reg_pb
from memstrata.nodeagent.proto import pluginregistration_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

SERVICE = "v1.DRAPlugin"  # the name the kubelet (>= 1.34) knows the v1 service by
PLUGIN_TYPE = "DRAPlugin"

# Why a device may not be given now (read from the device itself), None when it may.
Vet = Callable[[DraDevice], str | None]
# Reads a ResourceClaim (namespace, name) from the API server, as a dict.
ClaimReader = Callable[[str, str], dict[str, Any]]


class DraPlugin(pb_grpc.DRAPluginServicer, reg_grpc.RegistrationServicer):
    """The driver's two gRPC services. The constructor does no I/O; start() does."""

    def __init__(self, node_name: str, read_claim: ClaimReader, *, kubelet_dir: Path,
                 cdi_dir: Path = cdi.CDI_DIR, device_gid: int | None = None, vet: Vet | None = None,
                 on_unprepare: Callable[[list[str]], None] = lambda names: None,
                 on_registered: Callable[[], None] = lambda: None, metrics: AgentMetrics | None = None) -> None:
        self.node_name = node_name
        self.read_claim = read_claim
        # Where the kubelet looks: its plugin watcher scans plugins_registry; the service socket is ours to place.
        self.endpoint = Path(kubelet_dir) / "plugins" / dra.DRIVER / "dra.sock"
        self.registration = Path(kubelet_dir) / "plugins_registry" / f"{dra.DRIVER}-reg.sock"
        self.cdi_dir = Path(cdi_dir)
        self.device_gid = device_gid  # the group owning each device node in the container (cdi.spec)
        self.metrics = metrics or AgentMetrics()
        self._vet = vet
        self._on_unprepare = on_unprepare
        self._on_registered = on_registered
        self._lock = threading.Lock()  # prepare and unprepare of one node's devices, one at a time
        self._offered: list[DraDevice] = []
        self._server: grpc.Server | None = None
        self.registered = threading.Event()
        self.registration_error = ""

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        for sock in (self.endpoint, self.registration):
            sock.parent.mkdir(parents=True, exist_ok=True)
            sock.unlink(missing_ok=True)  # left by an earlier run: bind would fail
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dra"))
        pb_grpc.add_DRAPluginServicer_to_server(self, server)
        reg_grpc.add_RegistrationServicer_to_server(self, server)
        for sock in (self.endpoint, self.registration):
            if server.add_insecure_port(f"unix:{sock}") == 0:
                raise RuntimeError(f"{dra.DRIVER}: cannot listen on {sock}")
        server.start()
        self._server = server
        log.info("%s: serving on %s, registering through %s", dra.DRIVER, self.endpoint, self.registration)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
            self._server = None
        # The registration socket going away is how the kubelet learns that the plugin is gone.
        for sock in (self.registration, self.endpoint):
            sock.unlink(missing_ok=True)

    @property
    def offered(self) -> list[DraDevice]:
        with self._lock:
            return list(self._offered)

    def offer(self, devices: list[DraDevice]) -> None:
        """What prepare may hand out from now on (the slice's devices)."""
        with self._lock:
            self._offered = list(devices)

    # --- registration (pluginregistration v1) -----------------------------------

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(type=PLUGIN_TYPE, name=dra.DRIVER, endpoint=str(self.endpoint),
                                 supported_versions=[SERVICE])

    def NotifyRegistrationStatus(self, request: reg_pb.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg_pb.RegistrationStatusResponse:
        result = "ok" if request.plugin_registered else "error"
        self.metrics.registrations.labels(dra.DRIVER, result).inc()
        if request.plugin_registered:
            log.info("%s: registered with the kubelet", dra.DRIVER)
            self.registration_error = ""
            self.registered.set()
            self._on_registered()
        else:
            log.error("%s: the kubelet refused the plugin: %s", dra.DRIVER, request.error)
            self.registration_error = request.error
            self.registered.clear()
        return reg_pb.RegistrationStatusResponse()

    # --- DRA v1 -------------------------------------------------------------------

    def NodePrepareResources(self, request: pb.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> pb.NodePrepareResourcesResponse:
        out = {}
        for claim in request.claims:
            try:
                out[claim.uid] = pb.NodePrepareResourceResponse(devices=self._prepare(claim))
                self.metrics.allocations.labels(dra.DRIVER, "granted").inc()
            except PrepareError as exc:
                log.warning("refusing to prepare: %s", exc)
                self.metrics.allocations.labels(dra.DRIVER, "refused").inc()
                out[claim.uid] = pb.NodePrepareResourceResponse(error=str(exc))
            except Exception as exc:  # the API server away, a bad object: this claim fails, not the call
                log.exception("preparing claim %s/%s failed", claim.namespace, claim.name)
                out[claim.uid] = pb.NodePrepareResourceResponse(
                    error=f"{dra.DRIVER}: preparing ResourceClaim {claim.namespace}/{claim.name}: {exc}")
        return pb.NodePrepareResourcesResponse(claims=out)

    def _prepare(self, claim: pb.Claim) -> list[pb.Device]:
        where = f"ResourceClaim {claim.namespace}/{claim.name}"
        obj = self.read_claim(claim.namespace, claim.name)
        if (obj.get("metadata") or {}).get("uid") != claim.uid:
            raise PrepareError(f"{where}: UID {claim.uid} is gone (the claim was deleted and made again)")
        results = allocated(obj, self.node_name)
        with self._lock:
            # Asked again (a restarted kubelet): the devices hold this claim's own data, hand them over as before.
            if {r["device"] for r in results} == set(cdi.prepared_devices(self.cdi_dir, claim.uid)):
                return [_device_pb(r, claim.uid) for r in results]
            chosen = resolve(results, self._offered, where)
            self._check(chosen, where)
            cdi.write_spec(self.cdi_dir, claim.uid, chosen, self.device_gid)
        log.info("%s prepared: %s", where, [d.name for d in chosen])
        return [_device_pb(r, claim.uid) for r in results]

    def _check(self, chosen: list[DraDevice], where: str) -> None:
        if self._vet is None:
            return
        refused = {d.name: why for d in chosen if (why := self._vet(d)) is not None}
        if refused:
            raise PrepareError(f"{where}: devices not available now: "
                               + "; ".join(f"{name}: {why}" for name, why in refused.items()))

    def NodeUnprepareResources(self, request: pb.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> pb.NodeUnprepareResourcesResponse:
        out = {}
        with self._lock:
            for claim in request.claims:
                # Marked for the scrub before the spec (the record of what the claim had) goes: a crash in
                # between leaves the spec, and the kubelet asks again.
                used = cdi.prepared_namespaces(self.cdi_dir, claim.uid)
                try:
                    self._on_unprepare(used)
                except OSError as exc:
                    out[claim.uid] = pb.NodeUnprepareResourceResponse(
                        error=f"{dra.DRIVER}: cannot mark {used} for their scrub: {exc}")
                    continue
                removed = cdi.remove_spec(self.cdi_dir, claim.uid)
                log.info("ResourceClaim %s/%s unprepared%s; %s scrubbed before they are offered again", claim.namespace,
                         claim.name, "" if removed else " (it was not prepared here)", used or "nothing to be")
                out[claim.uid] = pb.NodeUnprepareResourceResponse()
        return pb.NodeUnprepareResourcesResponse(claims=out)


def _device_pb(result: dict[str, Any], claim_uid: str) -> pb.Device:
    # A prioritized list's result names its subrequest (namespaces/numa); a container names the request.
    device = pb.Device(request_names=[result["request"].split("/", 1)[0]], pool_name=result["pool"],
                       device_name=result["device"],
                       cdi_device_ids=[cdi.device_id(claim_uid, result["device"])])
    if result.get("shareID"):
        device.share_id = result["shareID"]
    return device
