"""The node agent and a namespace a job used: Unhealthy from the moment the job is gone with its data
on it, scrubbed, Healthy again; never handed to a pod in between.

The health decision is pure (nvme_devices over the scrubber's set); the rest runs `memstrata nodeagent`
in a subprocess against the kubelet stub (e2e/kubelet, a real gRPC peer), over a copy of the
two-socket-cxl sysfs case. In the loop-device tests the case's namespace nvme1n2 is wired to a real
loop device, and job A is the real engine in a child process.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memstrata.api.inventory import RESOURCE_NVME
from memstrata.node.header import State
from memstrata.nodeagent.devices import merge, nvme_devices
from e2e.operator.harness import free_port
from e2e.scrape import Samples, scrape
from kubelet_stub import REPO, KubeletStub
from sysfs_cases import ext4_head, inventory_of, memstrata_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))  # the loop-device helpers

from scrub_helpers import MiB, close_writer, kill_mid_write, read_all, start_writer, traces_of_a  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "sysfs"
# The two-socket-cxl case's free namespaces, by device ID: nvme0n1, nvme1n1, nvme1n2.
N0, N1, N2 = "eui.000000000000000001", "eui.000000000000000101", "eui.000000000000000102"
HEALTHY = {N0: ("Healthy", [0]), N1: ("Healthy", [1]), N2: ("Healthy", [1])}





def test_a_namespace_holding_a_finished_jobs_data_is_listed_unhealthy_until_scrubbed() -> None:
    inventory = inventory_of(DATA / "two-socket-cxl", hostname="")
    fresh = nvme_devices(inventory)
    assert [(d.name, d.healthy) for d in fresh] == [("nvme0n1", True), ("nvme1n1", True), ("nvme1n2", True)]
    dirty = nvme_devices(inventory, scrubbing={"nvme1n2"})
    assert [(d.name, d.healthy) for d in dirty] == [("nvme0n1", True), ("nvme1n1", True), ("nvme1n2", False)]
    # Offered, then dirty, then scrubbed: one device all along, its health following the scrub.
    listed = merge(merge(fresh, dirty), nvme_devices(inventory))
    assert [d.healthy for d in merge(fresh, dirty)] == [True, True, False]
    assert [d.healthy for d in listed] == [True, True, True] and [d.id for d in listed] == [d.id for d in fresh]


# -- the agent, a subprocess ------------------------------------------------------------------------
class Node:
    """The agent over `root` and the kubelet stub, in a short plugin dir (unix socket paths are short)."""

    def __init__(self, root: Path, stub_bin: Path, rescan: float) -> None:
        self.plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO / "operator"), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
        env.pop("NODE_NAME", None)
        self.log = root / "agent.log"
        self.metrics_port = free_port()
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "memstrata.cli", "nodeagent", "--", "--sysfs-root", str(root / "sys"),
             "--dev-root", str(root / "dev"), "--mountinfo", str(root / "proc" / "mounts"),
             "--swaps", str(root / "proc" / "swaps"), "--plugin-dir", str(self.plugin_dir),
             "--rescan-seconds", str(rescan), "--nfd-dir", str(root / "nfd"), "--log-level", "DEBUG",
             "--metrics-bind-address", f"127.0.0.1:{self.metrics_port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), env=env, cwd=REPO)
        self.stub = KubeletStub(stub_bin, self.plugin_dir).start()

    def nvme(self, timeout: float = 10.0) -> dict[str, tuple[str, list[int]]]:
        """The next NVMe device list ListAndWatch sent: ID -> (health, NUMA nodes)."""
        event = self.stub.wait_for("devices", timeout=timeout, resource=RESOURCE_NVME)
        return {d["id"]: (d["health"], d["numa"]) for d in event["devices"]}

    def metrics(self) -> Samples:
        """The agent's /metrics, as Prometheus scrapes it."""
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def stop(self) -> str:
        self.stub.stop()
        if self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        shutil.rmtree(self.plugin_dir, ignore_errors=True)
        return self.log.read_text()


@pytest.fixture
def node(case_copy, kubelet_stub_bin, grpc_code) -> Iterator[Callable[..., tuple[Path, Node]]]:
    started: list[Node] = []

    def start(rescan: float = 0.3, prepare: Callable[[Path], None] = lambda root: None) -> tuple[Path, Node]:
        root = case_copy("two-socket-cxl")
        (root / "nfd").mkdir()
        prepare(root)
        started.append(Node(root, kubelet_stub_bin, rescan))
        return root, started[-1]

    yield start
    for n in started:
        print(n.stop()[-4000:])


def test_allocate_refuses_a_namespace_a_job_left_dirty_since_the_last_scan(node) -> None:
    root, n = node(rescan=3600)  # no scan of its own comes in between
    assert n.nvme() == HEALTHY
    (root / "dev" / "nvme1n2.head").write_bytes(memstrata_head(State.OPEN))  # its job was just killed
    refused = n.stub.allocate(RESOURCE_NVME, [N2])
    assert "error" in refused, refused
    assert f"devices not available now: {N2} (/dev/nvme1n2): a job left it OPEN without scrubbing it; " \
           "the node agent scrubs it before offering it again" in refused["error"]
    # The refusal made the agent look at once (not in an hour): Unhealthy from now on.
    assert n.nvme(timeout=5) == {**HEALTHY, N2: ("Unhealthy", [1])}
    granted = n.stub.allocate(RESOURCE_NVME, [N1])
    assert "error" not in granted, granted
    # What Prometheus sees: one Allocate refused, one granted; the dirty namespace counted Unhealthy, as the
    # kubelet was told; both resources registered; the scans that found it.
    m = n.metrics()
    nvme = {"resource": RESOURCE_NVME}
    assert m.value("memstrata_nodeagent_allocations_total", **nvme, result="refused") == 1
    assert m.value("memstrata_nodeagent_allocations_total", **nvme, result="granted") == 1
    assert m.value("memstrata_nodeagent_devices", **nvme, kind="nvme", health="Unhealthy") == 1
    assert m.value("memstrata_nodeagent_devices", **nvme, kind="nvme", health="Healthy") == 2
    assert m.value("memstrata_nodeagent_kubelet_registrations_total", **nvme, result="ok") == 1
    assert m.value("memstrata_nodeagent_discovery_scans_total", result="ok") >= 2  # at start, and on the refusal
    assert m.value("memstrata_nodeagent_discovery_duration_seconds_count") == m.value(
        "memstrata_nodeagent_discovery_scans_total")


def test_allocate_refuses_a_namespace_that_gained_a_filesystem_since_the_last_scan(node) -> None:
    root, n = node(rescan=3600)
    assert n.nvme() == HEALTHY
    (root / "dev" / "nvme1n2.head").write_bytes(ext4_head())  # someone ran mkfs on it a moment ago
    refused = n.stub.allocate(RESOURCE_NVME, [N2])
    assert "error" in refused and f"{N2} (/dev/nvme1n2): it is not free any more: foreign signature: ext4" in \
        refused["error"], refused
    # Looked at again at once: the kubelet is told it is gone (Unhealthy), not in an hour.
    assert n.nvme(timeout=5) == {**HEALTHY, N2: ("Unhealthy", [1])}


def test_once_lists_a_dirty_namespace_unhealthy(cli, case_copy) -> None:
    root = case_copy("two-socket-cxl")
    (root / "dev" / "nvme1n2.head").write_bytes(memstrata_head(State.CLOSED))  # closed by an unscrubbing build
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}
    done = cli("nodeagent", "--", "--once", "--sysfs-root", str(root / "sys"), "--dev-root", str(root / "dev"),
               "--mountinfo", str(root / "proc" / "mounts"), env=env)
    assert done.returncode == 0, done.stderr
    listed = {d["name"]: d["healthy"] for d in json.loads(done.stdout)["devices"][RESOURCE_NVME]}
    assert listed == {"nvme0n1": True, "nvme1n1": True, "nvme1n2": False}


# -- with a real device behind nvme1n2 ----------------------------------------------------------------
def wire(root: Path, name: str, dev: str) -> str:
    """Make the case's namespace `name` the loop device `dev`: its sysfs entry carries dev's number (so the
    safety rule finds it by the device's own major:minor) and <dev root>/<name> is dev. Returns that path."""
    ndir = (root / "sys" / "block" / name).resolve()
    rdev = os.stat(dev).st_rdev
    number = f"{os.major(rdev)}:{os.minor(rdev)}"
    (ndir / "dev").write_text(number + "\n")
    for link in (root / "sys" / "dev" / "block" / number, root / "sys" / "class" / "block" / name):
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(ndir)
    (root / "dev" / f"{name}.head").unlink()
    (root / "dev" / name).symlink_to(dev)
    return str(root / "dev" / name)


@pytest.mark.loopdev
def test_a_killed_jobs_namespace_is_unhealthy_until_scrubbed_then_healthy(node, loop) -> None:
    dev = loop(64 * MiB)
    root, n = node(prepare=lambda root: wire(root, "nvme1n2", dev))
    assert n.nvme() == HEALTHY  # a blank device: nothing to scrub
    job_a = start_writer(str(root / "dev" / "nvme1n2"), "loop")
    try:
        # Held by its job: still Healthy, the kubelet counts it as that pod's (no new list is sent).
        with pytest.raises(TimeoutError):
            n.nvme(timeout=1.5)
    finally:
        in_flight = kill_mid_write(job_a, dev)
    assert in_flight > 0, "the kill did not land while job A's writes were in flight"
    health: list[str] = []
    while not health or health[-1] != "Healthy":
        health.append(n.nvme(timeout=30)[N2][0])
    assert health[0] == "Unhealthy", health  # from the first list after the kill until the scrub was done
    assert traces_of_a(read_all(dev)) == []
    granted = n.stub.allocate(RESOURCE_NVME, [N2])
    assert "error" not in granted, granted
    log = n.log.read_text()
    assert f"{root}/dev/nvme1n2: a job left it OPEN without scrubbing it; no process holds it any more: " \
           "scrubbing it now, Unhealthy until done" in log
    assert f"{root}/dev/nvme1n2: 64.0 MiB zeroed by punch-hole; offering it again" in log
    m = n.metrics()
    assert m.value("memstrata_nodeagent_scrubs_total", result="clean") == 1
    assert m.value("memstrata_nodeagent_scrubs_total", result="failed") == 0
    assert m.value("memstrata_nodeagent_scrub_duration_seconds_count") == 1
    assert m.value("memstrata_nodeagent_scrubs_running") == 0
    assert m.value("memstrata_nodeagent_devices", resource=RESOURCE_NVME, health="Healthy") == 3


@pytest.mark.loopdev
def test_a_cleanly_closed_namespace_never_needs_the_agent(node, loop) -> None:
    dev = loop(64 * MiB)
    root, n = node(prepare=lambda root: wire(root, "nvme1n2", dev))
    assert n.nvme() == HEALTHY
    close_writer(start_writer(str(root / "dev" / "nvme1n2"), "close"))
    with pytest.raises(TimeoutError):  # never Unhealthy: the engine scrubbed it before letting go
        n.nvme(timeout=1.5)
    assert traces_of_a(read_all(dev)) == []
    assert "scrubbing it now" not in n.log.read_text()


@pytest.mark.loopdev
def test_a_namespace_a_dra_claim_had_is_scrubbed_whatever_its_pod_wrote(case_copy, loop, tmp_path) -> None:
    """A claim's pod need not be memstrata's engine: it may write raw bytes without memstrata's header, which
    alone looks like a clean namespace. The unprepare's mark makes the scrub happen anyway, and survives the
    agent (a new Scrubber over the same marks directory finds it)."""
    from memstrata.nodeagent.scrubber import Scrubber

    root = case_copy("two-socket-cxl")
    dev = loop(64 * MiB)
    wire(root, "nvme1n2", dev)
    with open(dev, "r+b") as f:  # a user's pod: its data from byte 0, no header
        for offset in range(0, 64 * MiB, 8 * MiB):
            f.seek(offset)
            f.write(b"TENANT-A-RAW-DATA" * 64)
    inv = inventory_of(root, hostname="")
    where = {"sysfs_root": root / "sys", "mountinfo": root / "proc" / "mounts", "swaps": root / "proc" / "swaps"}
    assert Scrubber(root / "dev", **where, marks=tmp_path / "marks").update(inv, start=False) == frozenset()
    Scrubber(root / "dev", **where, marks=tmp_path / "marks").mark(["nvme1n2"])  # unprepare, by an earlier agent
    done: list[str] = []
    scrubber = Scrubber(root / "dev", **where, marks=tmp_path / "marks", on_done=lambda: done.append("x"))
    assert "a DRA claim's pod had it" in scrubber.pending("nvme1n2")
    assert scrubber.update(inv) == frozenset({"nvme1n2"})  # out of the offer from now on, scrubbing
    deadline = time.monotonic() + 60
    while not done and time.monotonic() < deadline:
        time.sleep(0.1)
    scrubber.stop()
    assert done and b"TENANT-A-RAW-DATA" not in read_all(dev)
    assert scrubber.pending("nvme1n2") is None and not (tmp_path / "marks" / "nvme1n2").exists()
    assert scrubber.update(inv) == frozenset()  # offered again
