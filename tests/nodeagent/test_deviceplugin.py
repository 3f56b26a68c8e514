"""The node agent's device plugins against the kubelet's side, over real unix sockets.

The kubelet side is e2e/kubelet (Go, upstream k8s.io/kubelet v1beta1 stubs),
written independently of the plugin. The agent runs as `memstrata nodeagent`
in a subprocess, over a writable copy of a sysfs case that the tests change
under it (a filesystem appears, a namespace vanishes).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import json

import pytest

from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.inventory import ENV_CXL_NODES, ENV_NVME_DEVICES, RESOURCE_CXL_GIB, RESOURCE_NVME, NodeInventory
from memstrata.nodeagent.devices import PluginDevice, preferred
from memstrata.plan import JobShape, plan_for_node
from kubelet_stub import REPO, KubeletStub
from sysfs_cases import ext4_head

NVME_IDS = {"eui.000000000000000001": "/dev/nvme0n1", "eui.000000000000000101": "/dev/nvme1n1",
            "eui.000000000000000102": "/dev/nvme1n2"}
# The two-socket-cxl case's namespaces: nvme0n1 100 GiB, nvme1n1 200 GiB, nvme1n2 10 GiB.
N0, N1, N2 = "eui.000000000000000001", "eui.000000000000000101", "eui.000000000000000102"
# GetPreferredAllocation on that node: (available, must include, allocation size) -> preferred IDs.
PREFERENCES = [
    (([N0, N1, N2], [], 1), [N1]),            # the largest
    (([N0, N1, N2], [], 2), [N1, N0]),        # the largest ones
    (([N0, N2], [], 1), [N0]),                # the largest of what the kubelet still has free
    (([N0, N1, N2], [N2], 2), [N2, N1]),      # already granted ones are kept, then the largest
    (([N0, N1, N2], [N2, N0], 2), [N2, N0]),  # already granted ones fill the request
    (([N0, N2], [], 3), [N0, N2]),            # fewer available than asked: all of them, largest first
    (([N0, "eui.gone"], [], 2), [N0]),        # an ID this plugin does not offer is never preferred
]


class Agent:
    def __init__(self, root: Path, plugin_dir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO / "operator"), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
        env.pop("NODE_NAME", None)
        self.log = root / "agent.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memstrata.cli", "nodeagent", "--", "--sysfs-root", str(root / "sys"),
             "--dev-root", str(root / "dev"), "--mountinfo", str(root / "proc" / "mounts"),
             "--plugin-dir", str(plugin_dir), "--rescan-seconds", "0.3", "--nfd-dir", str(root / "nfd"),
             "--log-level", "DEBUG"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), env=env, cwd=REPO)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.log.read_text()


@pytest.fixture
def node(case_copy, kubelet_stub_bin, grpc_code):
    root = case_copy("two-socket-cxl")
    (root / "nfd").mkdir()
    # Unix socket paths are limited to 108 bytes: keep the plugin dir short.
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    # The agent first, the kubelet later: the agent must keep retrying registration.
    agent = Agent(root, plugin_dir)
    stub = KubeletStub(kubelet_stub_bin, plugin_dir)
    time.sleep(0.5)
    stub.start()
    yield root, stub, agent
    stub.stop()
    log = agent.stop()
    shutil.rmtree(plugin_dir, ignore_errors=True)
    print(log[-3000:])


def devices(stub: KubeletStub, resource: str, timeout: float = 10.0) -> dict[str, tuple[str, list[int]]]:
    """The next device list ListAndWatch sent for `resource`: ID -> (health, NUMA nodes)."""
    event = stub.wait_for("devices", timeout=timeout, resource=resource)
    return {d["id"]: (d["health"], d["numa"]) for d in event["devices"]}


def devices_until(stub: KubeletStub, resource: str, want: dict, timeout: float = 5.0) -> float:
    """Seconds until ListAndWatch resends exactly `want` (fails after `timeout`)."""
    start = time.monotonic()
    last = None
    while (left := timeout - (time.monotonic() - start)) > 0:
        try:
            last = devices(stub, resource, timeout=left)
        except TimeoutError:
            break
        if last == want:
            return time.monotonic() - start
    raise AssertionError(f"ListAndWatch did not resend {want} within {timeout} s; last list: {last}")


def test_registers_and_lists_devices_with_numa_topology(node) -> None:
    root, stub, _ = node
    for resource, endpoint in ((RESOURCE_NVME, "memstrata-nvme-ns.sock"), (RESOURCE_CXL_GIB, "memstrata-cxl-gib.sock")):
        reg = stub.wait_for("register", resource=resource)
        assert (reg["version"], reg["endpoint"]) == ("v1beta1", endpoint)
    nvme = devices(stub, RESOURCE_NVME)
    assert nvme == {"eui.000000000000000001": ("Healthy", [0]), "eui.000000000000000101": ("Healthy", [1]),
                    "eui.000000000000000102": ("Healthy", [1])}
    cxl = devices(stub, RESOURCE_CXL_GIB)
    assert len(cxl) == 48
    assert sum(1 for h, numa in cxl.values() if numa == [2] and h == "Healthy") == 32
    assert sum(1 for h, numa in cxl.values() if numa == [3] and h == "Healthy") == 16
    # The NFD feature file follows the same inventory.
    nfd = root / "nfd" / "memstrata"
    deadline = time.monotonic() + 5
    while not nfd.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "memstrata-nvme-free-count=3" in nfd.read_text().splitlines()


def test_allocate_hands_out_device_nodes_and_env(node) -> None:
    _, stub, _ = node
    ids = list(devices(stub, RESOURCE_NVME))[:2]
    got = stub.allocate(RESOURCE_NVME, ids)
    assert "error" not in got, got
    (container,) = got["containers"]
    paths = [NVME_IDS[i] for i in ids]
    assert container["devices"] == [{"container_path": p, "host_path": p, "permissions": "rw"} for p in paths]
    assert container["envs"] == {ENV_NVME_DEVICES: ",".join(paths)}

    devices(stub, RESOURCE_CXL_GIB)
    got = stub.allocate(RESOURCE_CXL_GIB, ["cxl-node3-gib0", "cxl-node2-gib5", "cxl-node2-gib6"])
    (container,) = got["containers"]
    assert container["envs"] == {ENV_CXL_NODES: "2,3"} and container["devices"] == []

    bad = stub.allocate(RESOURCE_NVME, ["nvme9n9"])
    assert "unknown device IDs ['nvme9n9']" in bad["error"]


def test_namespace_that_gains_a_filesystem_or_vanishes_turns_unhealthy(node) -> None:
    root, stub, _ = node
    healthy = {i: ("Healthy", [0 if i.endswith("0001") else 1]) for i in NVME_IDS}
    assert devices(stub, RESOURCE_NVME) == healthy
    (root / "dev" / "nvme1n1.head").write_bytes(ext4_head())
    want = {**healthy, "eui.000000000000000101": ("Unhealthy", [1])}
    seconds = devices_until(stub, RESOURCE_NVME, want)
    print(f"filesystem seen as Unhealthy after {seconds:.2f} s")
    refused = stub.allocate(RESOURCE_NVME, ["eui.000000000000000101"])
    assert "no longer available" in refused["error"]

    # The namespace is deleted: its block device leaves sysfs.
    (root / "sys" / "block" / "nvme0n1").unlink()
    devices_until(stub, RESOURCE_NVME, {**want, "eui.000000000000000001": ("Unhealthy", [0])})


def test_kubelet_restart_is_followed_by_registration_within_5_s(node) -> None:
    _, stub, _ = node
    for resource in (RESOURCE_NVME, RESOURCE_CXL_GIB):
        stub.wait_for("register", resource=resource)
        devices(stub, resource)
    stub.restart()  # new kubelet.sock; the plugin sockets are wiped as the kubelet does
    ready = next(e for e in reversed(stub.seen) if e["event"] == "ready")
    for resource in (RESOURCE_NVME, RESOURCE_CXL_GIB):
        reg = stub.wait_for("register", timeout=5, resource=resource)
        seconds = (reg["time"] - ready["time"]) / 1e9
        print(f"{resource} re-registered {seconds:.2f} s after the kubelet restarted")
        assert seconds < 5
    assert len(devices(stub, RESOURCE_NVME)) == 3
    got = stub.allocate(RESOURCE_NVME, ["eui.000000000000000001"])
    assert got["containers"][0]["envs"] == {ENV_NVME_DEVICES: "/dev/nvme0n1"}


def test_sighup_re_registers(node) -> None:
    _, stub, agent = node
    stub.wait_for("register", resource=RESOURCE_NVME)
    devices(stub, RESOURCE_NVME)
    agent.proc.send_signal(signal.SIGHUP)
    stub.wait_for("register", timeout=5, resource=RESOURCE_NVME)
    assert len(devices(stub, RESOURCE_NVME)) == 3


def test_once_prints_inventory_and_a_malformed_tree_exits_2(cli, case_copy) -> None:
    data = Path(__file__).resolve().parents[1] / "data" / "sysfs"
    root = data / "two-socket-cxl"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}
    args = ["nodeagent", "--", "--once", "--sysfs-root", str(root / "sys"), "--dev-root", str(root / "dev"),
            "--mountinfo", str(root / "proc" / "mounts")]
    done = cli(*args, env=env)
    assert done.returncode == 0, done.stderr
    assert '"memstrata.dev/nvme-free-count": "3"' in done.stdout
    bad = data / "bad-nsid"
    done = cli(*args[:4], str(bad / "sys"), *args[5:], env=env)
    assert done.returncode == 2
    assert f"{bad / 'sys' / 'block' / 'nvme0n1' / 'nsid'}: expected an integer, found 'one'" in done.stderr


def preferred_via_kubelet(stub: KubeletStub, available: list[str], must: list[str], size: int) -> list[str]:
    stub.send(op="preferred", resource=RESOURCE_NVME, available=available, ids=must, size=size)
    got = stub.wait_for("preferred", resource=RESOURCE_NVME)
    assert "error" not in got, got
    return list(got["ids"])


def test_kubelet_is_told_to_grant_the_namespaces_the_plan_counted(node, cli) -> None:
    root, stub, _ = node
    options = {e["resource"]: e["options"] for e in (stub.wait_for("options", resource=r)
                                                     for r in (RESOURCE_NVME, RESOURCE_CXL_GIB))}
    assert options[RESOURCE_NVME]["get_preferred_allocation_available"] is True
    assert options[RESOURCE_CXL_GIB]["get_preferred_allocation_available"] is False  # any GiB unit will do
    listed = devices(stub, RESOURCE_NVME)
    for (available, must, size), want in PREFERENCES:
        assert preferred_via_kubelet(stub, available, must, size) == want, (available, must, size)

    # The planner, over the inventory the agent discovers on this node, counts exactly those namespaces.
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}
    done = cli("nodeagent", "--", "--once", "--sysfs-root", str(root / "sys"), "--dev-root", str(root / "dev"),
               "--mountinfo", str(root / "proc" / "mounts"), env=env)
    assert done.returncode == 0, done.stderr
    inventory = NodeInventory.model_validate(json.loads(done.stdout)["inventory"])
    name_of = {ns.wwid or ns.name: ns.name for ns in inventory.free_namespaces}
    healthy = [i for i, (health, _) in listed.items() if health == "Healthy"]
    job = JobShape(model=PRESETS["gpt-125m"], sequence_length=128, micro_batch=1, gpus=0, engine="memstrata")
    for count in range(1, len(healthy) + 1):
        plan = plan_for_node(job, inventory, MemoryPolicy(engine="memstrata", nvme_namespaces=count,
                                                          dram_budget=512 << 20))
        ids = preferred_via_kubelet(stub, healthy, [], count)
        assert plan.nvme_namespaces == [name_of[i] for i in ids]


def _ns(id_: str, name: str, gib: int, healthy: bool = True) -> PluginDevice:
    return PluginDevice(id=id_, healthy=healthy, numa_node=0, dev_path=f"/dev/{name}", name=name,
                        size_bytes=gib << 30)


@pytest.mark.parametrize(("available", "must", "size", "want"), [
    (["a", "b", "c"], [], 2, ["b", "c"]),            # b, c are 200 GiB; equal sizes go by namespace name
    (["a", "b", "c", "d"], [], 4, ["b", "c", "a", "d"]),
    (["a", "b", "c"], ["a"], 1, ["a"]),              # what is already granted is never dropped
    (["a", "b", "c"], ["a"], 2, ["a", "b"]),
    (["a", "b", "c", "d"], [], 0, []),
    (["a", "d", "sick"], [], 2, ["a", "d"]),         # an unhealthy namespace is never preferred
])
def test_preference_rule(available: list[str], must: list[str], size: int, want: list[str]) -> None:
    devs = [_ns("a", "nvme0n1", 100), _ns("b", "nvme1n1", 200), _ns("c", "nvme2n1", 200), _ns("d", "nvme3n1", 10),
            _ns("sick", "nvme4n1", 900, healthy=False)]
    assert preferred(RESOURCE_NVME, available, must, size, devs) == want
    assert preferred(RESOURCE_CXL_GIB, available, must, size, devs) == must  # no preference: the kubelet's pick
