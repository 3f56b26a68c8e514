"""One real Kubernetes node on this machine: containerd + runc, the kubelet and kube-proxy, joined to
a ControlPlane (e2e.cluster) that advertises the host's address.

    cp = ControlPlane(bin_dir, advertise_address=host_address()); cp.start()
    node = RealNode(cp, NodeBins.from_env()[0]); node.start()   # Ready in seconds
    node.restart_kubelet(); node.restart_containerd()           # the faults the tests inject
    node.stop()                                                  # containers, rules and mounts gone

Networking: Debian's CNI bridge + host-local give each pod an address on a bridge of its own
(10.244.0.0/24); kube-proxy (iptables) makes the `kubernetes` Service reach the API server at the
host's address, so in-cluster clients work exactly as on any node. Paths are fixed where the kubelet
and the chart fix them (/var/lib/kubelet, its device-plugins directory); containerd's root is a cache
(images survive between runs, keyed by their content), its state lives under /run.

This machine's root has no CAP_SYS_RESOURCE: containerd clamps oom_score_adj to its own
(`restrict_oom_score_adj`), or runc fails to start any container.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster.controlplane import ControlPlane, ControlPlaneError, cache_root, cluster_versions
from e2e.cluster.procs import die_with_parent, free_port, terminate
from e2e.cluster.pki import client_kubeconfig, sign_client
from e2e.realnode.images import ctr_command
from e2e.realnode.hoststate import (
    KUBELET_ROOT, HostSettings, LoopFiles, claim_kubelet_root, foreign_node_reason, kill_pod_processes, kill_shims,
    remove_kubelet_iptables, remove_tree,
)

NODE_NAME = "memstrata-e2e-node"
STATE = Path("/run/memstrata-node")
DAEMON_NICENESS = -5  # root may raise a priority
POD_CIDR = "10.244.0.0/24"
BRIDGE = "mse2e0"
CNI_BIN = Path("/usr/lib/cni")
HOST_TOOLS = ("runc", "iptables", "conntrack")
# Built by `make node-bins` beside the kubelet (containerd 2.x: CDI, which Debian's 1.6 lacks).
NODE_TOOLS = ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr")


@dataclass(frozen=True)
class NodeBins:
    kubelet: Path
    kube_proxy: Path

    @property
    def dir(self) -> Path:
        """Where containerd, its shim and ctr are too: first on the node daemons' (and the tests') PATH."""
        return self.kubelet.parent

    @staticmethod
    def from_env() -> tuple[NodeBins | None, str]:
        """The kubelet, kube-proxy and containerd `make node-bins` built, and why not when they or the host's
        tools are missing."""
        env = os.environ.get("MEMSTRATA_NODE_BIN")
        if env:
            path = Path(env)
        else:
            v = cluster_versions()
            path = cache_root() / f"node-{v['K8S_VERSION']}-containerd{v['CONTAINERD_VERSION']}" / "bin"
        missing = [b for b in NODE_TOOLS if not (path / b).is_file()]
        if missing:
            return None, f"the node's binaries are not built in {path} (missing {missing}); run `make node-bins`"
        tools = [t for t in HOST_TOOLS if shutil.which(t) is None] + ([] if (CNI_BIN / "bridge").exists() else ["cni bridge"])
        if tools:
            return None, f"host packages missing: {tools}; run `make node-bins` (it apt-installs them)"
        if os.geteuid() != 0:
            return None, "a real node needs root (containerd, iptables, mounts)"
        foreign = foreign_node_reason()
        if foreign:
            return None, foreign
        return NodeBins(path / "kubelet", path / "kube-proxy"), ""


def use_node_tools(bins: NodeBins) -> None:
    """Put the built containerd, its shim (containerd finds it on PATH) and ctr before any the host has, in
    this process's PATH: the node's daemons inherit it, and every `ctr` the tests run is this containerd's."""
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([str(bins.dir)] + [p for p in path if p != str(bins.dir)])


def host_address() -> str:
    """The address of the interface the default route leaves by: what pods reach the host at."""
    out = subprocess.run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True, text=True).stdout
    m = re.search(r"\bsrc (\d+\.\d+\.\d+\.\d+)", out)
    if not m:
        raise ControlPlaneError(f"no IPv4 default route to find the host's address (`ip route get`: {out.strip()!r})")
    return m.group(1)


class RealNode:
    """The node's processes; start()/stop(), or `with`."""

    def __init__(self, cluster: ControlPlane, bins: NodeBins, containerd_root: Path, name: str = NODE_NAME,
                 state: Path = STATE) -> None:
        if not cluster.advertise_address:
            raise ControlPlaneError("a real node needs a control plane started with advertise_address=host_address()")
        self.cluster = cluster
        self.bins = bins
        self.name = name
        self.address = cluster.advertise_address
        self.containerd_root = containerd_root
        # Beside containerd's root, so a killed run's leftovers are found by the next one.
        self.host_settings = HostSettings(containerd_root.parent / "realnode-sysctls.json")
        self.loop_files = LoopFiles(containerd_root.parent / "realnode-loops")
        self.workdir = cluster.workdir / "node"
        self.state = state
        self.socket = state / "containerd" / "containerd.sock"
        self.pause_image = ""
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._args: dict[str, list[str]] = {}

    def __enter__(self) -> RealNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lifecycle ----------------------------------------------------------
    def start_runtime(self, pause_image: str) -> None:
        """containerd alone (images are imported before the kubelet comes up), after clearing what a
        previous run that died without stop() left behind."""
        self.pause_image = pause_image
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._clear_leftovers()
        claim_kubelet_root()
        self._write_configs()
        self._spawn("containerd", [str(self.bins.dir / "containerd"), "--config", str(self.workdir / "containerd.toml")])
        self._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, 30)

    def start(self) -> None:
        """The kubelet and kube-proxy (containerd must be up: start_runtime); returns once the Node is
        Ready."""
        self.host_settings.save()
        self._spawn("kubelet", [str(self.bins.kubelet), f"--config={self.workdir / 'kubelet.yaml'}",
                                f"--kubeconfig={self.workdir / 'kubelet.kubeconfig'}",
                                f"--hostname-override={self.name}", f"--node-ip={self.address}",
                                f"--root-dir={KUBELET_ROOT}", "--v=2"])
        self._spawn("kube-proxy", [str(self.bins.kube_proxy), f"--config={self.workdir / 'kube-proxy.yaml'}", "--v=2"])
        self.wait_ready(120)

    def stop(self) -> None:
        """Pods' containers killed, then kube-proxy, kubelet and containerd stopped; iptables rules,
        the bridge and the pods' mounts removed. Safe after a failed start."""
        for name in ("kube-proxy", "kubelet"):
            if name in self._procs:
                terminate(self._procs.pop(name), grace_s=10)
        if "containerd" in self._procs:
            containerd = self._procs.pop("containerd")
            if containerd.poll() is None:
                self._kill_tasks()
            terminate(containerd, grace_s=10)
        self._clear_leftovers()

    def _clear_leftovers(self) -> None:
        """Everything the node made, whether this run's stop() or a killed run left it: shims and pods'
        processes, iptables rules, the bridge, the pods' mounts and network namespaces (under our state
        directory), the kubelet's state and sysctls, the loop devices."""
        kill_shims(self.socket)
        kill_pod_processes()
        subprocess.run([str(self.bins.kube_proxy), "--cleanup"], capture_output=True, timeout=60)
        remove_kubelet_iptables()
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
        self.host_settings.restore()
        for path in (KUBELET_ROOT, self.state, Path("/var/log/pods")):
            remove_tree(path)
        self.loop_files.clear()

    def restart_kubelet(self, down_seconds: float = 1.0) -> None:
        """SIGTERM the kubelet and start it again: running pods keep running, device plugins must
        register again (the kubelet re-creates kubelet.sock)."""
        terminate(self._procs.pop("kubelet"), grace_s=10)
        time.sleep(down_seconds)
        self._spawn("kubelet", self._args["kubelet"], append=True)

    def restart_containerd(self, down_seconds: float = 1.0) -> None:
        """SIGTERM containerd and start it again: containers keep running under their shims."""
        terminate(self._procs.pop("containerd"), grace_s=10)
        time.sleep(down_seconds)
        self._spawn("containerd", self._args["containerd"], append=True)
        self._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, 30)

    def alive(self) -> dict[str, bool]:
        return {n: p.poll() is None for n, p in self._procs.items()}

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            node = self.cluster.find_json("node", self.name) or {}
            conds = (node.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        self._wait(f"node {self.name} Ready", ready, timeout)

    def ctr(self, *args: str, check: bool = True, input: bytes | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[bytes]:
        """`ctr` against this node's containerd, namespace k8s.io (the kubelet's)."""
        proc = subprocess.run(ctr_command(str(self.socket), "k8s.io", *args), input=input, capture_output=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"ctr {' '.join(args)} failed: {proc.stderr.decode(errors='replace').strip()}")
        return proc

    def logs_tail(self, lines: int = 30) -> str:
        out = []
        for name in ("containerd", "kubelet", "kube-proxy"):
            log = self.workdir / f"{name}.log"
            if log.is_file():
                text = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"----- {log} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(out)

    def container_logs(self, namespace: str, pod: str) -> str:
        """A pod's container logs, read where the kubelet writes them."""
        out = []
        for f in sorted(Path("/var/log/pods").glob(f"{namespace}_{pod}_*/*/*.log")):
            out.append(f"--- {f}\n" + f.read_text(errors="replace")[-6000:])
        return "\n".join(out)

    def _kill_tasks(self) -> None:
        """Kill and remove every container of the kubelet's namespace: containers outlive containerd (their
        shims keep them), so stopping containerd alone would leave training processes running."""
        for task in self.ctr("tasks", "ls", "-q", check=False, timeout=60).stdout.decode().split():
            # --force kills a task that is still running and waits for it.
            self.ctr("tasks", "delete", "--force", task, check=False, timeout=60)
        containers = self.ctr("containers", "ls", "-q", check=False, timeout=60).stdout.decode().split()
        if containers:
            self.ctr("containers", "delete", *containers, check=False, timeout=60)

    # -- configuration --------------------------------------------------------
    def _write_configs(self) -> None:
        pki, w = self.cluster.pki, self.workdir
        cert, key = sign_client(pki, w / "pki", "kubelet", f"system:node:{self.name}", "system:nodes")
        (w / "kubelet.kubeconfig").write_text(client_kubeconfig(self.cluster.server, pki.ca_cert, cert, key))
        pcert, pkey = sign_client(pki, w / "pki", "kube-proxy", "system:kube-proxy", "system:node-proxier")
        (w / "kube-proxy.kubeconfig").write_text(client_kubeconfig(self.cluster.server, pki.ca_cert, pcert, pkey))
        cni = w / "cni"
        cni.mkdir(exist_ok=True)
        (cni / "10-memstrata-e2e.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "memstrata-e2e", "plugins": [
                # No masquerade: pods reach only the host's own address (the API server), which needs
                # none, and ipMasq adds per-pod NAT rules that only a CNI DEL would remove.
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(self.state / "cni-ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))
        (w / "containerd.toml").write_text(self._containerd_toml(cni))
        (w / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # Kubernetes >= 1.35 refuses cgroup v1 unless told; this machine has nothing else.
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "address": self.address, "port": 10250, "readOnlyPort": 0, "healthzPort": free_port(),
            "healthzBindAddress": "127.0.0.1",
            # The images are imported, never pulled: garbage-collecting one would fail the next pod.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            # A test machine's disk is often fuller than the defaults allow; evict only when it is nearly full.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "resolvConf": "/etc/resolv.conf", "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "4s", "syncFrequency": "10s",
        }, indent=1))
        (w / "kube-proxy.yaml").write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "mode": "iptables", "clusterCIDR": POD_CIDR, "hostnameOverride": self.name,
            "clientConnection": {"kubeconfig": str(w / "kube-proxy.kubeconfig")},
            # No CAP_SYS_RESOURCE-free sysctl writes: leave the conntrack table as the host has it.
            "conntrack": {"maxPerCore": 0, "min": 0},
            "healthzBindAddress": f"127.0.0.1:{free_port()}", "metricsBindAddress": f"127.0.0.1:{free_port()}",
        }, indent=1))


    def _containerd_toml(self, cni: Path) -> str:
        """containerd 2.x's config (version 3) for this node: its own root and state, CDI on."""
        return f"""version = 3
root = "{self.containerd_root}"
state = "{self.state / 'containerd'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.socket}"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{self.pause_image}"
[plugins."io.containerd.cri.v1.runtime"]
  # No CAP_SYS_RESOURCE here: a negative oom_score_adj would make runc fail every container.
  restrict_oom_score_adj = true
  # Pods' network namespaces under our state directory: unmounting it frees them (and their veths) even
  # when no CNI DEL ran (containers killed without the CRI).
  netns_mounts_under_state_dir = true
  # DRA: the kubelet names a claim's CDI devices; the driver writes their specs under /var/run/cdi.
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{cni}"
"""

    # -- plumbing ---------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], append: bool = False) -> None:
        self._args[name] = args
        with open(self.workdir / f"{name}.log", "ab" if append else "wb") as log:
            self._procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 start_new_session=True, cwd=self.workdir,
                                                 preexec_fn=_node_daemon)

    def _wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead:
                raise ControlPlaneError(f"{', '.join(dead)} exited while waiting for {what}\n{self.logs_tail()}")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs_tail()}")
            time.sleep(0.5)


def _node_daemon() -> None:
    """In a node daemon's child before exec: it dies with the test process, and it (with the pods containerd starts)
    comes before the other stages make test runs beside this one (conftest.py), as a node's system-reserved CPU
    puts it, so that its own deadlines (containerd's dial, the kubelet's probes) hold on a busy machine."""
    die_with_parent()
    os.nice(DAEMON_NICENESS)
