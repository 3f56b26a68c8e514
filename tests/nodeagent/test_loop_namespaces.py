"""`memstrata nodeagent --loop-namespaces`: loop devices advertised as namespaces on a node without NVMe.

Pure tests over small sysfs trees (the dram-only case plus loop devices laid out as the kernel does:
block/loopN -> devices/virtual/block/loopN, with loop/backing_file while a file is attached), the
CLI over those trees, and one test against a real loop device made here with losetup.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path
from typing import Any

import pytest

from memstrata.api.inventory import (
    LABEL_LOOP_NAMESPACES, LABEL_NVME_FREE, LABEL_NVME_FREE_GIB, RESOURCE_NVME, NodeInventory, read_node,
    render_node,
)
from memstrata.api.units import GiB
from memstrata.node.discovery import SysfsError, dev_heads, discover
from memstrata.nodeagent.devices import grant, nvme_devices
from memstrata.nodeagent.labels import nfd_features, node_patch
from sysfs_cases import Tree, ext4_head, memstrata_head, swap_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))  # the loop-device helpers
from native_helpers import need_tool, run  # noqa: E402

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
IMAGE = "/var/lib/memstrata-test/ns{}.img"


def add_loop(root: Path, n: int, size: int, *, backing: str | None = "", **kw: Any) -> str:
    """loop<n> in the tree at `root`, attached to `backing` (default: a file of its own; None: detached, as
    after a reboot)."""
    return Tree(root).loop(n, size, backing=IMAGE.format(n) if backing == "" else backing, **kw)


def inventory_of(root: Path, names: list[str], *, mounts: str = "", swaps: str = "") -> NodeInventory:
    base = (root / "proc" / "mounts").read_text()
    return discover(root / "sys", heads=dev_heads(root / "dev"), mounts_text=base + mounts,
                    swaps_text="Filename Type Size Used Priority\n" + swaps, hostname="n1", loop_names=names)


@pytest.fixture
def node(case_copy) -> Path:
    """A node without NVMe, with loop3 (1 GiB, 4 KiB blocks) and loop4 (64 MiB) attached to files."""
    root = case_copy("dram-only")
    add_loop(root, 3, GiB, lbs=4096)
    add_loop(root, 4, 64 * MiB, backing="/var/lib/memstrata-test/other.img")
    return root


def test_only_the_named_loop_device_is_listed_as_a_free_namespace_of_kind_loop(node: Path) -> None:
    inv = inventory_of(node, ["loop3"])
    (ns,) = inv.nvme_namespaces  # loop4 is attached too, but not named: someone else's
    assert (ns.name, ns.kind, ns.free, ns.reason) == ("loop3", "loop", True, None)
    assert (ns.size_bytes, ns.logical_block_size, ns.nsid, ns.controller) == (GiB, 4096, 1, "")
    assert (ns.numa_node, ns.wwid, ns.dev_path) == (None, None, "/dev/loop3")
    # The device plugin offers it like a namespace and hands the container its /dev node.
    (dev,) = nvme_devices(inv)
    assert (dev.id, dev.dev_path, dev.healthy, dev.size_bytes) == ("loop3", "/dev/loop3", True, GiB)
    assert grant(RESOURCE_NVME, ["loop3"], [dev]).device_paths == ("/dev/loop3",)
    # Both named, in the order named, each once.
    assert [n.name for n in inventory_of(node, ["loop4", "loop3", "loop4"]).nvme_namespaces] == ["loop4", "loop3"]


def test_the_node_says_it_advertises_loop_devices_and_the_operator_reads_them_back(node: Path) -> None:
    inv = inventory_of(node, ["loop3", "loop4"])
    rendered = render_node(inv)
    labels = rendered["labels"]
    assert labels[LABEL_LOOP_NAMESPACES] == "true"
    assert (labels[LABEL_NVME_FREE], labels[LABEL_NVME_FREE_GIB]) == ("2", "1")
    assert "memstrata-loop-namespaces=true" in nfd_features(inv).splitlines()
    back = read_node({"metadata": {"name": "n1", "labels": labels, "annotations": rendered["annotations"]}})
    assert back == inv and [n.kind for n in back.nvme_namespaces] == ["loop", "loop"]


def test_without_the_opt_in_no_loop_device_is_listed_and_the_label_is_removed(node: Path) -> None:
    inv = inventory_of(node, [])
    assert inv.nvme_namespaces == []
    assert LABEL_LOOP_NAMESPACES not in render_node(inv)["labels"]
    assert not any(line.startswith("memstrata-loop-namespaces") for line in nfd_features(inv).splitlines())
    # A merge patch removes a label only when it names it null: an agent restarted without the opt-in
    # must take the label off a node that had it.
    assert node_patch(inv)["metadata"]["labels"][LABEL_LOOP_NAMESPACES] is None
    assert node_patch(inventory_of(node, ["loop3"]))["metadata"]["labels"][LABEL_LOOP_NAMESPACES] == "true"


@pytest.mark.parametrize("kwargs, mounts, swaps, reason", [
    ({"partitions": 2}, "", "", "has partitions (loop5p1, loop5p2)"),
    ({"holders": ("dm-0",)}, "", "", "held by dm-0"),
    ({"head": ext4_head()}, "", "", "foreign signature: ext4"),
    ({"head": ext4_head()}, "/dev/loop5 /mnt/img ext4 rw 0 0\n", "", "foreign signature: ext4; mounted at /mnt/img"),
    ({"head": swap_head()}, "", "/dev/loop5 partition 1024 0 -2\n",
     "foreign signature: swap; active swap (/dev/loop5)"),
    ({"ro": True}, "", "", "read-only"),
    ({"backing": None}, "", "", "detached: no backing file (attach one with losetup)"),
    ({"backing": "/dev/sdb"}, "", "", "backed by the block device /dev/sdb, not a file: writing it would write "
                                      "that device"),
])
def test_a_loop_device_in_use_is_listed_not_free_with_the_reason(node: Path, kwargs, mounts, swaps, reason) -> None:
    add_loop(node, 5, 64 * MiB, **kwargs)
    inv = inventory_of(node, ["loop5"], mounts=mounts, swaps=swaps)
    (ns,) = inv.nvme_namespaces
    assert (ns.free, ns.reason) == (False, reason)
    assert nvme_devices(inv) == [] and render_node(inv)["labels"][LABEL_NVME_FREE] == "0"


def test_memstratas_own_header_leaves_a_loop_device_free(node: Path) -> None:
    add_loop(node, 5, 64 * MiB, head=memstrata_head())
    assert inventory_of(node, ["loop5"]).nvme_namespaces[0].free


def test_a_loop_device_sharing_its_backing_file_is_not_free(node: Path) -> None:
    """`losetup -f FILE` attaches an attached file again: two jobs would write the same bytes."""
    add_loop(node, 5, 64 * MiB, backing="/srv/ns.img")
    add_loop(node, 6, 64 * MiB, backing="/srv/ns.img")  # not named: someone mounted it, say
    inv = inventory_of(node, ["loop5", "loop3"], mounts="/dev/loop6 /mnt/img ext4 rw 0 0\n")
    five, three = inv.nvme_namespaces
    assert (five.free, five.reason) == (False, "shares its backing file /srv/ns.img with loop6")
    assert three.free  # a file of its own


def test_a_loop_device_gone_after_a_reboot_is_listed_not_free(node: Path) -> None:
    (ns,) = inventory_of(node, ["loop9"]).nvme_namespaces
    assert (ns.name, ns.free, ns.size_bytes) == ("loop9", False, 0)
    assert ns.reason == "no such loop device (attach a file with `losetup -f --show FILE`)"


@pytest.mark.parametrize("name, problem", [
    ("nvme0n1", "'nvme0n1' is not a loop device name (loop<N>, e.g. loop3)"),
])
def test_a_name_that_is_no_loop_device_is_an_error_naming_it(node: Path, name: str, problem: str) -> None:
    with pytest.raises(SysfsError) as err:
        inventory_of(node, ["loop3", name])
    assert err.value.path == str(node / "sys" / "block" / name) and err.value.problem == problem


def test_a_garbled_loop_device_attribute_is_an_error_naming_the_file(node: Path) -> None:
    (node / "sys" / "devices" / "virtual" / "block" / "loop3" / "size").write_text("lots\n")
    with pytest.raises(SysfsError) as err:
        inventory_of(node, ["loop3"])
    assert err.value.path == str(node / "sys" / "block" / "loop3" / "size")
    assert err.value.problem == "expected an integer, found 'lots'"


# -- the CLI ------------------------------------------------------------------------------------------
def once(cli, root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}
    return cli("nodeagent", "--", "--once", "--node-name", "", "--sysfs-root", str(root / "sys"), "--dev-root",
               str(root / "dev"), "--mountinfo", str(root / "proc" / "mounts"), *flags, env=env)


def test_once_lists_the_named_loop_devices_and_refuses_bad_names_at_parsing(cli, node: Path) -> None:
    done = once(cli, node, "--loop-namespaces", "loop3,loop4")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [(n["name"], n["kind"], n["free"]) for n in out["inventory"]["nvmeNamespaces"]] == [
        ("loop3", "loop", True), ("loop4", "loop", True)]
    assert out["node"]["labels"][LABEL_LOOP_NAMESPACES] == "true"
    assert [d["dev_path"] for d in out["devices"][RESOURCE_NVME]] == ["/dev/loop3", "/dev/loop4"]
    for bad in ("nvme0n1", "/dev/loop3", "loop", "loop3,sda"):
        done = once(cli, node, "--loop-namespaces", bad)
        assert done.returncode == 2 and "argument --loop-namespaces:" in done.stderr, done.stderr
        assert "not a loop device name" in done.stderr and repr(bad.split(",")[-1]) in done.stderr
    done = once(cli, node, "--loop-namespaces", "loop3,loop9")  # loop9 gone (a reboot): listed, not offered
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [(n["name"], n["free"]) for n in listed["inventory"]["nvmeNamespaces"]] == [("loop3", True), ("loop9", False)]
    assert [d["dev_path"] for d in listed["devices"][RESOURCE_NVME]] == ["/dev/loop3"]
    done = once(cli, node)  # off by default
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["inventory"].get("nvmeNamespaces", []) == [] and LABEL_LOOP_NAMESPACES not in out["node"]["labels"]


# -- a real loop device -------------------------------------------------------------------------------
@pytest.mark.loopdev
def test_a_real_loop_device_is_free_until_it_gets_a_filesystem(cli, loop) -> None:
    mkfs = need_tool("mkfs.ext4", "e2fsprogs")
    dev = loop(64 * MiB)
    name = Path(dev).name
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}
    args = ("nodeagent", "--", "--once", "--loop-namespaces", name, "--node-name", "")

    def listed() -> tuple[dict, list[dict]]:
        done = cli(*args, env=env)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        (ns,) = [n for n in out["inventory"]["nvmeNamespaces"] if n["name"] == name]
        assert out["node"]["labels"][LABEL_LOOP_NAMESPACES] == "true"
        return ns, [d for d in out["devices"][RESOURCE_NVME] if d["name"] == name]

    ns, offered = listed()
    assert (ns["kind"], ns["free"], ns["sizeBytes"], ns["logicalBlockSize"]) == ("loop", True, 64 * MiB, 512)
    assert [(d["dev_path"], d["healthy"]) for d in offered] == [(dev, True)]
    run(mkfs, "-q", "-F", dev)
    ns, offered = listed()
    assert (ns["free"], ns["reason"], offered) == (False, "foreign signature: ext4", [])


@pytest.mark.loopdev
def test_a_namespace_the_training_user_cannot_open_is_not_offered_and_the_inventory_says_why(cli, loop) -> None:
    """A node without udev's rules leaves block devices root:root 0600: the training container (uid 1000, group
    disk) would fail at its first read, so the agent must not offer it, and must say why."""
    dev = loop(64 * MiB)
    name = Path(dev).name
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}

    def listed(*flags: str) -> tuple[dict[str, Any], list[str]]:
        done = cli("nodeagent", "--", "--once", "--loop-namespaces", name, "--node-name", "", *flags, env=env)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        (ns,) = [n for n in out["inventory"]["nvmeNamespaces"] if n["name"] == name]
        return ns, [d["dev_path"] for d in out["devices"][RESOURCE_NVME] if d["name"] == name]

    ns, offered = listed()  # root:disk 0660, as a node's udev makes it (the fixture sets it)
    assert (ns["free"], offered) == (True, [dev])
    os.chown(dev, 0, 0)
    os.chmod(dev, 0o600)
    ns, offered = listed()
    assert (ns["free"], offered) == (False, [])
    assert ns["reason"].startswith(f"{dev} is owned by 0:0 with mode 0600: the training container (uid 1000, "
                                   "groups 1000,6) cannot open it for reading and writing"), ns["reason"]
    # The chart's trainingPod.deviceGroup null: the node's containerd gives devices to the pod's user, no check.
    ns, offered = listed("--training-device-gid", "none")
    assert (ns["free"], offered) == (True, [dev])
    os.chmod(dev, 0o660)  # root:root 0660: still not the pod's group ...
    assert listed()[0]["free"] is False
    os.chown(dev, 0, 6)  # root:disk 0660: offered again at the next scan
    assert listed()[1] == [dev]
    done = cli("nodeagent", "--", "--once", "--training-device-gid", "disk", env=env)
    assert done.returncode == 2 and "argument --training-device-gid: device group 'disk'" in done.stderr, done.stderr
