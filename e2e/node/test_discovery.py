"""Inside the QEMU guest, `memstrata nodeagent --once` reports exactly the node QEMU built,
and offers only the free namespace to the kubelet. Run with `make test-guest`.

The guest (e2e/node/guest.py): NUMA node 0 with both CPUs, memory-only node 1,
a CXL Type-3 expander (serial 0x1234, 512 MiB) onlined as a CPU-less node in a
lower tier, and NVMe controller `deadbeef` with namespaces nsid 1 free, 2 ext4,
3 GPT-partitioned, 4 held by device-mapper. Device names (nvme0nX) follow the
kernel's probe order, not the nsid, so everything here is keyed by nsid.
"""
from __future__ import annotations

import pytest

from guest import json_from_guest, missing_reason

pytestmark = [pytest.mark.guest, pytest.mark.slow]

SCRIPT = r'''
import subprocess, sys
done = subprocess.run([sys.executable, "-m", "memstrata.cli", "nodeagent", "--", "--once",
                       "--mountinfo", "/proc/self/mountinfo", "--node-name", "guest"],
                      capture_output=True, text=True, timeout=120)
open("/out/once.json", "w").write(done.stdout)
sys.stderr.write(done.stderr)
sys.exit(done.returncode)
'''


@pytest.fixture(scope="module")
def once() -> dict:
    reason = missing_reason()
    if reason:
        pytest.skip(f"QEMU GUEST UNAVAILABLE — {reason}")
    return json_from_guest(SCRIPT, "once.json")


def test_numa_topology_is_exactly_what_qemu_built(once: dict) -> None:
    nodes = {n["id"]: n for n in once["inventory"]["numaNodes"]}
    assert sorted(nodes) == [0, 1, 2], nodes
    assert (nodes[0]["kind"], nodes[0]["cpus"]) == ("dram", [0, 1])
    assert (nodes[1]["kind"], nodes[1]["cpus"]) == ("memory-only", [])
    assert (nodes[2]["kind"], nodes[2]["cpus"]) == ("cxl", [])
    assert nodes[2]["tier"] > nodes[0]["tier"], "the CXL node must sit in a slower memory tier"
    assert 450 << 20 <= nodes[1]["memoryBytes"] <= 512 << 20
    (cxl,) = once["inventory"]["cxlNodes"]
    assert (cxl["numaNode"], cxl["memoryBytes"], cxl["region"]) == (2, 512 << 20, "region0")
    assert cxl["memdevs"] == [{"name": "mem0", "serial": "0x1234", "ramBytes": 512 << 20}]


def test_namespaces_and_why_three_are_refused(once: dict) -> None:
    (ctrl,) = once["inventory"]["nvmeControllers"]
    assert (ctrl["name"], ctrl["serial"], ctrl["model"], ctrl["transport"]) == (
        "nvme0", "deadbeef", "QEMU NVMe Ctrl", "pcie")
    ns = {n["nsid"]: n for n in once["inventory"]["nvmeNamespaces"]}
    assert sorted(ns) == [1, 2, 3, 4], "hidden per-path nodes must not be counted"
    assert all(n["controller"] == "nvme0" for n in ns.values()), ns
    assert ns[1]["free"] and ns[1]["sizeBytes"] == 256 << 20 and "reason" not in ns[1]
    assert ns[2]["reason"] == "foreign signature: ext4"
    # Every reason, the signature first (checked always, even behind a memstrata header).
    assert ns[3]["reason"].startswith("foreign signature: gpt")
    assert ns[3]["reason"].endswith(f"has partitions ({ns[3]['name']}p1)")
    assert ns[4]["reason"].startswith("held by dm-")


def test_only_the_free_namespace_is_offered(once: dict) -> None:
    ns1 = next(n for n in once["inventory"]["nvmeNamespaces"] if n["nsid"] == 1)
    (device,) = once["devices"]["memstrata.dev/nvme-ns"]
    assert (device["id"], device["dev_path"], device["healthy"]) == (ns1["wwid"], f"/dev/{ns1['name']}", True)
    # 512 MiB of CXL is less than one whole GiB unit: nothing to offer, but the labels say it is there.
    assert once["devices"]["memstrata.dev/cxl-gib"] == []
    labels = once["node"]["labels"]
    assert labels["memstrata.dev/cxl"] == "true" and labels["memstrata.dev/cxl-node-count"] == "1"
    assert labels["memstrata.dev/nvme-free-count"] == "1"
    assert once["node"]["capacity"] == {"memstrata.dev/nvme-ns": "1", "memstrata.dev/cxl-gib": "0"}


def test_the_guests_cxl_node_and_free_namespace_are_in_the_resourceslice_it_builds(once: dict) -> None:
    """The DRA driver's slice, built in the guest by the same discovery (`--once` prints it), names the CXL node's
    bytes and expander and the one free namespace. (The real API server's acceptance of a slice built from a
    discovered CXL node: e2e/cluster/test_dra_allocation.py; asking for the control plane here would put this
    module on a second worker, with a second QEMU boot.)"""
    from memstrata.api import dra

    spec = once["resourceSlice"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == (dra.DRIVER, "guest", "guest")
    devices = {d["attributes"]["kind"]["string"]: d for d in spec["devices"]}
    assert len(spec["devices"]) == 2, spec["devices"]
    cxl, ns = devices[dra.KIND_CXL], devices[dra.KIND_NVME]
    assert cxl["name"] == "cxl-node2" and cxl["capacity"][dra.MEMORY]["value"] == str(512 << 20)
    assert cxl["attributes"]["expanders"] == {"string": "mem0"} and cxl["attributes"]["numaNode"] == {"int": 2}
    free = next(n for n in once["inventory"]["nvmeNamespaces"] if n["free"])
    assert ns["attributes"]["namespace"] == {"string": free["name"]}
    assert ns["attributes"]["model"] == {"string": "QEMU NVMe Ctrl"} and ns["capacity"][dra.SIZE]["value"] == str(256 << 20)
