"""Discovery over sysfs trees: the hand-made corner cases and the QEMU guest's capture."""
from __future__ import annotations

from pathlib import Path

import pytest

from memstrata.api.inventory import (
    LABEL_CXL, LABEL_CXL_GIB, LABEL_CXL_NODES, LABEL_DRAM_GIB, LABEL_NVME_FREE, LABEL_NVME_FREE_GIB,
    RESOURCE_CXL_GIB, RESOURCE_NVME, NodeInventory, read_node, render_node,
)
from memstrata.api.units import GiB
from memstrata.nodeagent.devices import cxl_devices, nvme_devices
from memstrata.node.discovery import SysfsError, dev_heads, discover
from memstrata.nodeagent.labels import nfd_features
from sysfs_cases import ext4_head, inventory_of, memstrata_head

DATA = Path(__file__).resolve().parents[1] / "data" / "sysfs"


def by_name(inv: NodeInventory) -> dict:
    return {ns.name: ns for ns in inv.nvme_namespaces}


def test_two_sockets_two_cxl_nodes_and_an_hmem_node() -> None:
    inv = inventory_of(DATA / "two-socket-cxl")
    kinds = {n.id: (n.kind, n.tier) for n in inv.numa_nodes}
    # node5 is possible but empty: nothing to place there, so not reported.
    assert kinds == {0: ("dram", 4), 1: ("dram", 4), 2: ("cxl", 22), 3: ("cxl", 22), 4: ("memory-only", 4)}
    assert inv.numa_nodes[0].cpus == [0, 1, 2, 3, 8, 9, 10, 11]
    assert inv.numa_nodes[2].distances == [14, 24, 10, 26, 20]
    assert inv.dram_bytes == 128 * GiB
    cxl = {c.numa_node: c for c in inv.cxl_nodes}
    assert sorted(cxl) == [2, 3]
    assert cxl[2].region == "region0" and cxl[2].dax_device == "dax0.0"
    assert [(m.name, m.serial, m.ram_bytes) for m in cxl[2].memdevs] == [
        ("mem0", "0x1111", 16 * GiB), ("mem1", "0x2222", 16 * GiB)]
    assert cxl[3].memory_bytes == 16 * GiB + (512 << 20)


def test_namespaces_free_only_when_nothing_else_can_own_them() -> None:
    inv = inventory_of(DATA / "two-socket-cxl")
    ns = by_name(inv)
    # Hidden per-path nodes (nvme1c1n*) are not namespaces of their own.
    assert sorted(ns) == ["nvme0n1", "nvme0n2", "nvme1n1", "nvme1n2", "nvme1n3", "nvme1n4", "nvme1n5", "nvme1n6",
                          "nvme1n7", "nvme1n8"]
    assert {n for n, v in ns.items() if v.free} == {"nvme0n1", "nvme1n1", "nvme1n2"}  # nvme1n2: memstrata's own
    assert ns["nvme0n2"].reason == "mounted at /scratch"
    assert ns["nvme1n3"].reason == "foreign signature: ext4"
    assert ns["nvme1n4"].reason == "read-only"
    assert ns["nvme1n5"].reason == "has partitions (nvme1n5p1, nvme1n5p2); mounted at /data"
    assert ns["nvme1n6"].reason == "held by dm-0"
    assert ns["nvme1n7"].reason == "foreign signature: swap; active swap (/dev/nvme1n7)"
    # A GPT written after memstrata used the namespace keeps memstrata's magic in front: still refused.
    assert ns["nvme1n8"].reason == "foreign signature: gpt (GPT partition table)"
    # Multipath (nvme1) and direct (nvme0) layouts both lead to the controller and its NUMA node.
    assert (ns["nvme0n1"].controller, ns["nvme0n1"].numa_node, ns["nvme0n1"].logical_block_size) == ("nvme0", 0, 4096)
    assert (ns["nvme1n1"].controller, ns["nvme1n1"].numa_node, ns["nvme1n1"].size_bytes) == ("nvme1", 1, 200 * GiB)
    assert ns["nvme1n1"].wwid == "eui.000000000000000101"
    ctrl = {c.name: c for c in inv.nvme_controllers}
    assert (ctrl["nvme1"].model, ctrl["nvme1"].serial, ctrl["nvme1"].firmware, ctrl["nvme1"].transport) == (
        "Example NVMe 1", "SN0001", "1.0", "pcie")


def test_labels_and_resources_from_the_inventory() -> None:
    inv = inventory_of(DATA / "two-socket-cxl")
    rendered = render_node(inv)
    labels = rendered["labels"]
    assert (labels[LABEL_CXL], labels[LABEL_CXL_GIB], labels[LABEL_CXL_NODES]) == ("true", "48", "2")
    assert (labels[LABEL_NVME_FREE], labels[LABEL_NVME_FREE_GIB], labels[LABEL_DRAM_GIB]) == ("3", "310", "128")
    node = {"metadata": {"name": "n1", "labels": labels, "annotations": rendered["annotations"]}}
    assert read_node(node) == inv
    assert len(nvme_devices(inv)) == int(rendered["capacity"][RESOURCE_NVME])
    assert len(cxl_devices(inv)) == 32 + 16 == int(rendered["capacity"][RESOURCE_CXL_GIB])
    features = nfd_features(inv).splitlines()
    assert "memstrata-cxl-capacity-gib=48" in features and "memstrata-nvme-free-count=3" in features


def test_a_node_without_cxl_or_nvme() -> None:
    inv = inventory_of(DATA / "dram-only")
    assert [(n.id, n.kind) for n in inv.numa_nodes] == [(0, "dram")]
    assert inv.cxl_nodes == [] and inv.nvme_controllers == [] and inv.nvme_namespaces == []
    assert render_node(inv)["labels"][LABEL_CXL] == "false"


def test_mountinfo_matches_by_device_number_whatever_the_mount_source(case_copy) -> None:
    root = case_copy("two-socket-cxl")
    # Mounted through a by-id link: only the major:minor in mountinfo names the device.
    mountinfo = "36 25 259:1 / /mnt/x rw,relatime shared:1 - xfs /dev/disk/by-id/nvme-x rw\n"
    assert by_name(inventory_of(root, mountinfo))["nvme0n1"].reason == "mounted at /mnt/x"


def test_a_filesystem_written_after_discovery_is_seen_on_the_next(case_copy) -> None:
    root = case_copy("two-socket-cxl")
    assert by_name(inventory_of(root))["nvme1n1"].free
    (root / "dev" / "nvme1n1.head").write_bytes(ext4_head())
    assert by_name(inventory_of(root))["nvme1n1"].reason == "foreign signature: ext4"
    (root / "dev" / "nvme1n1.head").unlink()  # and unreadable first blocks are never taken as blank
    reason = by_name(inventory_of(root))["nvme1n1"].reason
    assert reason is not None and reason.startswith("first blocks unreadable")


def test_a_namespace_in_use_is_refused_for_every_reason_signature_first(case_copy) -> None:
    root = case_copy("two-socket-cxl")
    (root / "dev" / "nvme0n2.head").write_bytes(ext4_head())  # the filesystem mounted at /scratch
    (root / "dev" / "nvme1n4.head").write_bytes(memstrata_head())  # memstrata's own, but read-only now
    ns = by_name(inventory_of(root))
    assert ns["nvme0n2"].reason == "foreign signature: ext4; mounted at /scratch"
    assert ns["nvme1n4"].reason == "read-only"


@pytest.mark.parametrize("swaps, reason", [
    # Swap on the namespace itself, and on a partition of it (the partition refuses it as well).
    ("/dev/nvme0n1 partition 1024 0 -2", "active swap (/dev/nvme0n1)"),
    ("/dev/nvme1n5p1 partition 1024 0 -2", "has partitions (nvme1n5p1, nvme1n5p2); mounted at /data; "
                                           "active swap (/dev/nvme1n5p1)"),
])
def test_active_swap_is_never_free_whatever_its_first_blocks_say(case_copy, swaps: str, reason: str) -> None:
    root = case_copy("two-socket-cxl")
    (root / "proc" / "swaps").write_text("Filename Type Size Used Priority\n" + swaps + "\n")
    name = swaps.split()[0].removeprefix("/dev/").removesuffix("p1")
    ns = by_name(inventory_of(root))[name]
    assert not ns.free and ns.reason == reason


@pytest.mark.parametrize("case, file, problem", [
    ("bad-meminfo", "devices/system/node/node0/meminfo", "no 'MemTotal: <n> kB' line"),
    ("bad-cpulist", "devices/system/node/node0/cpulist", "expected a list like 0-3,8 but found '0-x'"),
    ("bad-nsid", "block/nvme0n1/nsid", "expected an integer, found 'one'"),
    ("missing-size", "block/nvme0n1/size", "missing"),
    ("cxl-missing-region", "bus/cxl/devices/region0", "missing, but a dax device names it"),
    ("no-nodes", "devices/system/node", "no node<N> directories"),
])
def test_malformed_trees_name_the_file(case: str, file: str, problem: str) -> None:
    root = DATA / case
    with pytest.raises(SysfsError) as err:
        inventory_of(root)
    assert err.value.path == str(root / "sys" / file)
    assert problem in str(err.value)


def test_missing_sysfs_root_is_an_error_not_a_crash(tmp_path: Path) -> None:
    with pytest.raises(SysfsError, match="not a directory"):
        discover(tmp_path / "nope", heads=dev_heads(tmp_path), mounts_text="", swaps_text="")


QEMU = DATA / "qemu-cxl-nvme"


def test_qemu_guest_capture() -> None:
    """The tree captured in the QEMU guest (e2e/node/capture_sysfs.py): the topology its QEMU command builds."""
    if not (QEMU / "sys").is_dir():
        pytest.skip(f"QEMU CAPTURE ABSENT — {QEMU} not committed yet (made by the guest's capture_sysfs.py)")
    inv = inventory_of(QEMU)
    assert [(n.id, n.kind, n.cpus) for n in inv.numa_nodes] == [
        (0, "dram", [0, 1]), (1, "memory-only", []), (2, "cxl", [])]
    tiers = {n.id: n.tier for n in inv.numa_nodes}
    assert tiers[2] is not None and tiers[0] is not None and tiers[2] > tiers[0]
    (cxl,) = inv.cxl_nodes
    assert cxl.numa_node == 2 and cxl.region and cxl.dax_device
    assert [(m.serial, m.ram_bytes) for m in cxl.memdevs] == [("0x1234", 512 << 20)]
    (ctrl,) = inv.nvme_controllers
    assert ctrl.serial == "deadbeef" and ctrl.model.startswith("QEMU NVMe")
    # Device names follow the kernel's probe order, not the nsid: key by nsid.
    ns = {n.nsid: n for n in inv.nvme_namespaces}
    assert sorted(ns) == [1, 2, 3, 4] and {n.controller for n in ns.values()} == {ctrl.name}
    assert ns[1].free and ns[1].size_bytes == 256 << 20
    assert ns[2].reason == "foreign signature: ext4"
    assert ns[3].reason == f"foreign signature: gpt (GPT partition table); has partitions ({ns[3].name}p1)"
    assert ns[4].reason is not None and ns[4].reason.startswith("held by dm-")
