"""`memstrata nodeagent`: discover the node's strata, label the Node, serve the device plugins.

    memstrata nodeagent                 # the DaemonSet's command (NODE_NAME from the downward API)
    memstrata nodeagent --once          # print the inventory, labels and plugin devices as JSON, exit
    memstrata nodeagent --loop-namespaces loop3,loop4   # test clusters: these loop devices as namespaces
    memstrata nodeagent --metrics-bind-address :9090    # Prometheus metrics on http://<node>:9090/metrics

The DaemonSet pod needs the host's /sys, /dev (hostPath) and mount table
(hostPID, so /proc/1/mountinfo is the host's), and
/var/lib/kubelet/device-plugins. It writes to a namespace only to scrub what a
job left on it (memstrata.nodeagent.scrubber), after the namespace-safety rule.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstrata.api.inventory import NodeInventory, render_node
from memstrata.api.podidentity import DISK_GID, TrainingIdentity, parse_device_gid
from memstrata.api.serving import METRICS_PORT, parse_bind_address
from memstrata.node.access import dev_ownership, vet_access
from memstrata.node.discovery import SysfsError, dev_heads, discover, read_swaps
from memstrata.node.loopscan import LOOP_NAME
from memstrata.nodeagent.cdi import CDI_DIR
from memstrata.api.dra import DRIVER
from memstrata.nodeagent.labels import NFD_FEATURES_DIR, NFD_FILE, nfd_features, node_patch, write_atomically
from memstrata.nodeagent.scrubber import Scrubber

if TYPE_CHECKING:
    from memstrata.nodeagent.devices import PluginDevice, Resource
    from memstrata.nodeagent.metrics import AgentMetrics

log = logging.getLogger("memstrata.nodeagent")
KUBELET_DIR = Path("/var/lib/kubelet")  # the kubelet's --root-dir
PLUGIN_DIR = KUBELET_DIR / "device-plugins"  # the device plugins' (the DRA plugin's are under KUBELET_DIR)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="memstrata nodeagent", description=__doc__.splitlines()[0])
    p.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    p.add_argument("--dev-root", type=Path, default=Path("/dev"),
                   help="where namespaces' device nodes are (or <name>.head captures)")
    p.add_argument("--mountinfo", type=Path, default=Path("/proc/1/mountinfo"),
                   help="the host's mount table (/proc/mounts or mountinfo format)")
    p.add_argument("--swaps", type=Path, default=Path("/proc/swaps"),
                   help="active swap areas (/proc/swaps is the host's in any mount namespace)")
    p.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR, help="the kubelet's device-plugins directory")
    p.add_argument("--device-api", choices=("device-plugin", "dra"), default="device-plugin",
                   help="how the kubelet and the scheduler get the devices: device-plugin (counted extended "
                        "resources) or dra (a ResourceSlice per node and the DRA kubelet plugin dra.memstrata.dev; "
                        "Kubernetes >= 1.36). Never both: two allocators would hand one namespace to two jobs")
    p.add_argument("--kubelet-dir", type=Path, default=KUBELET_DIR,
                   help="the kubelet's root directory (dra: its plugins and plugins_registry directories)")
    p.add_argument("--cdi-dir", type=Path, default=CDI_DIR,
                   help="where the container runtime reads CDI specs (dra: one per prepared claim)")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                   help="Node to label (default $NODE_NAME; empty: do not talk to the API server)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    p.add_argument("--nfd-dir", type=Path, default=NFD_FEATURES_DIR,
                   help="NFD local feature directory; written only when it exists")
    p.add_argument("--rescan-seconds", type=float, default=5.0,
                   help="how often namespaces are re-checked (health) and labels refreshed")
    p.add_argument("--loop-namespaces", type=loop_names, default=(), metavar="loopN[,loopN...]",
                   help="also advertise these loop devices as namespaces (test and development clusters without "
                        "NVMe: they are files on the node's filesystem); the node is labelled "
                        "memstrata.dev/loop-namespaces=true. Default: none")
    p.add_argument("--training-device-gid", type=device_gid, default=DISK_GID, metavar="GID|none",
                   help="the supplementary group the operator gives training pods (its flag of the same name); a "
                        "namespace whose device node that group (with the runtime's uid) cannot open read-write is "
                        "not offered, and the inventory says why. none: the node's containerd hands devices to the "
                        f"pod's user, nothing to check. Default: {DISK_GID}")
    p.add_argument("--metrics-bind-address", type=bind_address, default=None, metavar="HOST:PORT",
                   help=f"serve Prometheus metrics on http://HOST:PORT/metrics, e.g. :{METRICS_PORT} (default: off)")
    p.add_argument("--once", action="store_true", help="discover, print JSON and exit")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.rescan_seconds <= 0:
        p.error(f"--rescan-seconds must be positive, got {args.rescan_seconds}")
    if args.device_api == "dra" and not args.node_name and not args.once:
        p.error("--device-api dra needs --node-name (or $NODE_NAME): the node's ResourceSlice is named after it")
    return args


def loop_names(text: str) -> tuple[str, ...]:
    """`loop3,loop4` as names; anything but loop<N> names is refused here, before the agent looks at a device."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if not LOOP_NAME.match(n)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, bad))}: not {'a loop device name' if len(bad) == 1 else 'loop device names'}; "
            "give block device names like loop3 (no /dev/), comma-separated")
    return names


def bind_address(text: str) -> tuple[str, int] | None:
    try:
        return parse_bind_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def device_gid(text: str) -> int | None:
    try:
        return parse_device_gid(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def read_inventory(args: argparse.Namespace) -> NodeInventory:
    try:
        mounts = args.mountinfo.read_text()
    except OSError as exc:
        raise SysfsError(args.mountinfo, f"cannot read the mount table: {exc.strerror}") from exc
    try:
        swaps = read_swaps(args.swaps)
    except OSError as exc:
        raise SysfsError(args.swaps, f"cannot read the active swap areas: {exc.strerror}") from exc
    found = discover(args.sysfs_root, heads=dev_heads(args.dev_root), mounts_text=mounts, swaps_text=swaps,
                     hostname=args.node_name or socket.gethostname(), loop_names=args.loop_namespaces)
    if args.training_device_gid is None:  # containerd gives each device to the pod's own user
        return found
    return vet_access(found, dev_ownership(args.dev_root), TrainingIdentity(device_gid=args.training_device_gid))


def scrubber(args: argparse.Namespace, on_done: Callable[[], None] = lambda: None,
             metrics: "AgentMetrics | None" = None, marks: Path | None = None) -> Scrubber:
    """The scrubber over the same device nodes, sysfs, mount table and swaps discovery reads."""
    return Scrubber(args.dev_root, sysfs_root=args.sysfs_root, mountinfo=args.mountinfo, swaps=args.swaps,
                    on_done=on_done, metrics=metrics, marks=marks)


def once(args: argparse.Namespace) -> int:
    from memstrata.nodeagent.devices import resources
    from memstrata.nodeagent.draslice import slice_spec

    inventory = read_inventory(args)
    check = scrubber(args)
    scrubbing = check.update(inventory, start=False)  # reported Unhealthy; --once writes nothing
    devices = {r.name: [d.__dict__ for d in r.devices(inventory, scrubbing)] for r in resources()}
    # What --device-api dra would publish (generation 1, as a first publication): the same discovery, seen by DRA.
    spec = slice_spec(inventory, args.node_name or inventory.hostname, 1, scrubbing | check.held)
    print(json.dumps({"inventory": inventory.wire(), "node": render_node(inventory), "devices": devices,
                      "resourceSlice": spec}, indent=2))
    return 0


class NodePatcher:
    """Puts labels and the inventory annotation on the Node, only when they changed."""

    def __init__(self, node_name: str, kubeconfig: str | None) -> None:
        self.node_name = node_name
        self.kubeconfig = kubeconfig
        self._api: Any = None
        self._last: dict[str, Any] | None = None

    def apply(self, inventory: NodeInventory) -> None:
        patch = node_patch(inventory)
        if not self.node_name or patch == self._last:
            return
        from kubernetes import client

        from memstrata.nodeagent.drapublish import api_client

        if self._api is None:
            self._api = client.CoreV1Api(api_client(self.kubeconfig))
        self._api.patch_node(self.node_name, patch)
        self._last = patch
        log.info("labelled node %s: %s", self.node_name, patch["metadata"]["labels"])


class Agent:
    """The plugins and the one event loop that restarts them."""

    def __init__(self, args: argparse.Namespace) -> None:
        from memstrata.nodeagent.deviceplugin import DevicePluginServer
        from memstrata.nodeagent.devices import resources
        from memstrata.nodeagent.metrics import AgentMetrics

        self.args = args
        # SimpleQueue.put is reentrant: safe to call from the signal handlers below and the scrub threads.
        self.events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.metrics = AgentMetrics()
        self.metrics.devices.offered = lambda: [(s.resource, d) for s in self.servers for d in s.devices] + (
            self.dra.listed() if self.dra is not None else [])
        dra = args.device_api == "dra"
        marks = args.kubelet_dir / "plugins" / DRIVER / "scrub-marks" if dra else None
        self.scrubber = scrubber(args, on_done=lambda: self.events.put("rescan"), metrics=self.metrics, marks=marks)
        self.servers = [] if dra else [DevicePluginServer(r, args.plugin_dir, vet=self.vet, metrics=self.metrics)
                                       for r in resources()]
        self.dra = None
        if dra:
            from memstrata.nodeagent.dradriver import DraDriver

            self.dra = DraDriver(args, vet=lambda d: self.vet_namespace(d.namespace),
                                 on_unprepare=self.unprepared, metrics=self.metrics,
                                 rescan=lambda: self.events.put("rescan"))
        self.patcher = NodePatcher(args.node_name, args.kubeconfig)
        self.inventory: NodeInventory | None = None
        self.scrubbing: frozenset[str] = frozenset()  # free namespaces holding a finished job's data

    def unprepared(self, names: list[str]) -> None:
        """A claim's pod is gone: every namespace it had is scrubbed before it is offered again (the scan asked for
        now starts it)."""
        self.scrubber.mark(names)
        self.events.put("rescan")

    def vet(self, device: PluginDevice) -> str | None:
        """Allocate's last look at a namespace (PluginDevice.name)."""
        return self.vet_namespace(device.name)

    def vet_namespace(self, name: str) -> str | None:
        """The last look at namespace `name` before a container gets it: refused when it fails the safety rule now
        (the last scan may be seconds old), or while a job's data is on it."""
        if not name:
            return None
        unsafe = self.unsafe_now(name)
        if unsafe is not None:
            self.events.put("rescan")  # it leaves the offer at once, not at the next tick
            return unsafe
        why = self.scrubber.pending(name)
        if why is None:
            return None
        self.events.put("rescan")  # have the scrub start now, not at the next tick
        return f"{why}; the node agent scrubs it before offering it again"

    def unsafe_now(self, name: str) -> str | None:
        """Why namespace `name` is not free now, by the rule discovery applies (mounted, partitioned, a foreign
        signature, held, read-only, not openable by the training pods' group), read afresh: the last scan may be
        seconds old. None when it is free."""
        try:
            now = read_inventory(self.args)
        except SysfsError as exc:
            return f"the node's devices cannot be read now: {exc}"
        ns = next((n for n in now.nvme_namespaces if n.name == name), None)
        if ns is None:
            return "it is gone from the node"
        return None if ns.free else f"it is not free any more: {ns.reason}"

    def offer(self, resource: Resource) -> list[PluginDevice]:
        assert self.inventory is not None
        return resource.devices(self.inventory, self.scrubbing)

    def rescan(self) -> None:
        """Re-discover; health changes reach ListAndWatch, label changes the Node."""
        started = time.monotonic()
        try:
            self.inventory = read_inventory(self.args)
        except SysfsError as exc:  # a device mid-removal can leave a half-read tree; next scan retries
            log.warning("discovery failed, keeping the previous inventory: %s", exc)
            self.metrics.scans.labels("error").inc()
            return
        finally:
            self.metrics.scan_seconds.observe(time.monotonic() - started)
        self.metrics.scans.labels("ok").inc()
        # Before publishing: a namespace a killed job left dirty must turn Unhealthy in this very scan.
        self.scrubbing = self.scrubber.update(self.inventory)
        for server in self.servers:
            server.publish(self.offer(server.manager))
        if self.dra is not None:
            self.dra.rescan(self.inventory, self.scrubbing | self.scrubber.held)
        if self.args.nfd_dir.is_dir():
            write_atomically(self.args.nfd_dir / NFD_FILE, nfd_features(self.inventory))
        try:
            self.patcher.apply(self.inventory)
        except Exception as exc:  # the API server being away must not stop the plugins
            log.warning("could not label node %s (will retry): %s", self.args.node_name, exc)

    def restart_plugins(self) -> None:
        """Serve afresh and register every resource; raises when the kubelet is not there."""
        for server in self.servers:
            server.stop()
        from memstrata.nodeagent.deviceplugin import DevicePluginServer

        self.servers = [DevicePluginServer(s.manager, self.args.plugin_dir, vet=self.vet, metrics=self.metrics)
                        for s in self.servers]
        for server in self.servers:
            server.start()
            if self.inventory is not None:
                server.publish(self.offer(server.manager))
            server.register()

    def serve_metrics(self) -> Any:
        """Start serving /metrics when asked to (the server, or None); a port taken ends the agent, saying so."""
        if self.args.metrics_bind_address is None:
            return None
        from prometheus_client import start_http_server

        host, port = self.args.metrics_bind_address
        try:
            server, _ = start_http_server(port, host, self.metrics.registry)
        except OSError as exc:
            raise SystemExit(f"memstrata nodeagent: --metrics-bind-address {host}:{port}: "
                             f"{exc.strerror or exc}") from None
        log.info("serving metrics on http://%s:%d/metrics", host, port)
        return server

    def run(self) -> int:
        from memstrata.nodeagent.deviceplugin import KUBELET_SOCKET, RegistrationError, socket_identity

        for sig, name in ((signal.SIGHUP, "sighup"), (signal.SIGTERM, "stop"), (signal.SIGINT, "stop")):
            signal.signal(sig, lambda *_, n=name: self.events.put(n))
        kubelet_sock = self.args.plugin_dir / KUBELET_SOCKET
        self.inventory = read_inventory(self.args)  # a tree that cannot be read at start is fatal
        metrics_server = self.serve_metrics()
        if self.dra is not None:  # the kubelet's plugin watcher finds it, also after the kubelet restarts
            self.dra.start()
        restart_due = 0.0  # when to (re)start the plugins; inf while they run
        next_scan = 0.0
        registered_with = None
        # The one event loop. Causes of a plugin restart, all handled here:
        #  - start-up, and a failed registration (retried every second: the kubelet may be starting);
        #  - kubelet.sock re-created: a restarted kubelet forgot us and wiped our sockets;
        #  - SIGHUP: the operator asks for a full re-read and re-registration.
        # Between restarts a rescan every --rescan-seconds publishes health changes
        # (ListAndWatch resends) and label changes; a finished scrub or a refused
        # Allocate ("rescan") asks for one at once. Ticks are 0.25 s so that a
        # kubelet restart is answered well within the 5 s the kubelet allows.
        while True:
            try:
                event = self.events.get(timeout=0.25)
            except queue.Empty:
                event = "tick"
            if event == "stop":
                break
            if event == "sighup":
                log.info("SIGHUP: re-discovering and re-registering")
                next_scan = restart_due = 0.0
            if event == "rescan":
                next_scan = 0.0
            now = time.monotonic()
            if now >= next_scan:
                self.rescan()
                next_scan = now + self.args.rescan_seconds
            identity = socket_identity(kubelet_sock)
            if restart_due == float("inf") and identity != registered_with:
                log.info("%s re-created: the kubelet restarted; registering again", kubelet_sock)
                restart_due = now
            if now >= restart_due and identity is not None:
                try:
                    self.restart_plugins()
                    registered_with, restart_due = identity, float("inf")
                except RegistrationError as exc:
                    log.warning("%s; retrying in 1 s", exc)
                    restart_due = now + 1.0
        for server in self.servers:
            server.stop()
        if self.dra is not None:
            self.dra.stop()
        self.scrubber.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
        log.info("stopped")
        return 0


def main(argv: list[str]) -> int:
    # `memstrata nodeagent -- --once`: the CLI hands over everything after the subcommand.
    args = parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.once:
            return once(args)
        return Agent(args).run()
    except SysfsError as exc:
        print(f"memstrata nodeagent: error: {exc}", file=sys.stderr)
        return 2
