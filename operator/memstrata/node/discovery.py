"""What memory and storage strata a node has, read from sysfs.

    inventory = discover("/sys", heads=dev_heads("/dev"), mounts_text=open("/proc/self/mountinfo").read(),
                         swaps_text=read_swaps("/proc/swaps"))

NUMA nodes come from /sys/devices/system/node (CPUs, MemTotal, distances)
and the kernel's memory tiers. A CPU-less node is CXL when the memory that
made it comes from a dax device onlined by kmem inside a CXL region; the
region's targets lead to the CXL memdevs (serial, RAM size) behind it. Any
other CPU-less node with memory is `memory-only` (HBM, firmware-onlined
memory, an emulated node). NVMe lives in `memstrata.node.nvmescan`; loop devices
named by the caller (the node agent's --loop-namespaces) in `memstrata.node.loopscan`.

Parsing only: the one thing read outside the sysfs root is the first blocks
of each namespace, through the `heads` callable the caller passes in; the
mount table and /proc/swaps come in as text. A tree
that cannot be read as a node raises `SysfsError` naming the file.
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memstrata.api.inventory import CxlMemdev, CxlNode, NodeInventory, NumaNode
from memstrata.node import nvmescan
from memstrata.node.loopscan import loop_namespaces
from memstrata.node.nvmescan import HeadReader
from memstrata.node.sysfs import SysfsError, SysfsTree
from memstrata.node.safety import PROBE_BYTES, parse_mounts, parse_swaps, read_head, read_swaps

__all__ = ["SysfsError", "discover", "dev_heads", "read_swaps"]

NODES = "devices/system/node"
TIERS = "devices/virtual/memory_tiering"
_MEMTOTAL = re.compile(r"MemTotal:\s+(\d+)\s*kB")


@dataclass(frozen=True)
class DaxDevice:
    name: str
    target_node: int
    driver: str | None
    region: str | None  # the CXL region it was carved from, if any


def _mem_total(tree: SysfsTree, node: str) -> int:
    rel = f"{NODES}/{node}/meminfo"
    m = _MEMTOTAL.search(tree.text(rel) or "")
    if not m:
        raise SysfsError(tree.path(rel), "no 'MemTotal: <n> kB' line")
    return int(m.group(1)) * 1024


def _tiers(tree: SysfsTree) -> dict[int, int]:
    """NUMA node -> memory tier number (memory_tier4 is the kernel's default DRAM tier)."""
    tier_of: dict[int, int] = {}
    for entry in tree.entries(TIERS, "memory_tier*"):
        suffix = entry.removeprefix("memory_tier")
        if not suffix.isdigit():
            continue
        for node in tree.int_list(f"{TIERS}/{entry}/nodelist") or []:
            tier_of[node] = int(suffix)
    return tier_of


def dax_devices(tree: SysfsTree) -> list[DaxDevice]:
    out = []
    for name in tree.entries("bus/dax/devices", "dax*"):
        rel = f"bus/dax/devices/{name}"
        target = tree.int(f"{rel}/target_node")
        assert target is not None
        # dax<region>.<n> sits under .../region<R>/dax_region<R>/ when a CXL region made it.
        region = next((p for p in tree.resolve(rel).parts if re.fullmatch(r"region\d+", p)), None)
        out.append(DaxDevice(name, target, tree.link_name(f"{rel}/driver"), region))
    return out


def _memdev_of(tree: SysfsTree, decoder: str) -> str:
    """The memdev behind an endpoint decoder: its port's `uport` link names it
    (the port is the decoder's parent); some layouts nest the port under the memdev."""
    rel = f"bus/cxl/devices/{decoder}"
    real = tree.resolve(rel)
    uport = tree.link_name(Path(*real.parent.parts) / "uport")
    if uport and re.fullmatch(r"mem\d+", uport):
        return uport
    mem = next((p for p in reversed(real.parts) if re.fullmatch(r"mem\d+", p)), None)
    if mem is None:
        raise SysfsError(tree.path(rel), "endpoint decoder leads to no CXL memdev (no port uport link)")
    return mem


def _memdevs(tree: SysfsTree, region: str) -> list[CxlMemdev]:
    base = f"bus/cxl/devices/{region}"
    if not tree.exists(base):
        raise SysfsError(tree.path(base), "missing, but a dax device names it as its CXL region")
    ways = tree.int(f"{base}/interleave_ways") or 0
    out = []
    for i in range(ways):
        decoder = tree.text(f"{base}/target{i}")
        if not decoder:
            raise SysfsError(tree.path(f"{base}/target{i}"), f"empty, but interleave_ways is {ways}")
        mem = _memdev_of(tree, decoder)
        serial = tree.text(f"bus/cxl/devices/{mem}/serial", required=False)
        out.append(CxlMemdev(name=mem, serial=serial or None,
                             ram_bytes=tree.int(f"bus/cxl/devices/{mem}/ram/size", required=False) or 0))
    return out


def numa_and_cxl(tree: SysfsTree) -> tuple[list[NumaNode], list[CxlNode]]:
    names = [n for n in tree.entries(NODES, "node*") if n[4:].isdigit()]
    if not names:
        raise SysfsError(tree.path(NODES), "no node<N> directories: not a sysfs tree, or a kernel without NUMA")
    tier_of = _tiers(tree)
    kmem = [d for d in dax_devices(tree) if d.driver == "kmem"]
    numa: list[NumaNode] = []
    cxl: list[CxlNode] = []
    for name in names:
        nid = int(name[4:])
        cpus = tree.int_list(f"{NODES}/{name}/cpulist") or []
        mem = _mem_total(tree, name)
        if not cpus and mem == 0:
            continue  # a possible node with nothing behind it (an unpopulated CXL window)
        kind = "dram" if cpus else "memory-only"
        regions = [d for d in kmem if d.target_node == nid and d.region]
        if not cpus and regions:
            kind = "cxl"
            cxl.append(CxlNode(
                numa_node=nid, memory_bytes=mem, region=regions[0].region, dax_device=regions[0].name,
                memdevs=[m for d in regions for m in _memdevs(tree, d.region or "")],
            ))
        numa.append(NumaNode(id=nid, kind=kind, cpus=cpus, memory_bytes=mem,
                             distances=tree.ints(f"{NODES}/{name}/distance") or [], tier=tier_of.get(nid)))
    return numa, cxl


def discover(sysfs_root: str | Path = "/sys", *, heads: HeadReader, mounts_text: str, swaps_text: str,
             hostname: str = "", loop_names: Sequence[str] = ()) -> NodeInventory:
    """The node's inventory; raises SysfsError naming the file when the tree is malformed or partial.

    `mounts_text` is a mount table (mountinfo or /proc/mounts format), `swaps_text`
    /proc/swaps: a namespace mounted or swapped on is never free. `loop_names`
    (`loop3`) are loop devices to list as namespaces after the NVMe ones (test and
    development clusters only); none by default."""
    tree = SysfsTree(sysfs_root)
    if not tree.path("").is_dir():
        raise SysfsError(tree.root, "sysfs root is not a directory")
    numa, cxl = numa_and_cxl(tree)
    ctrls = nvmescan.controllers(tree)
    mounts, swaps = parse_mounts(mounts_text), parse_swaps(swaps_text)
    namespaces = nvmescan.namespaces(tree, heads, mounts, swaps, ctrls)
    namespaces += loop_namespaces(tree, loop_names, heads, mounts, swaps)
    return NodeInventory(hostname=hostname, numa_nodes=numa, cxl_nodes=cxl, nvme_controllers=ctrls,
                         nvme_namespaces=namespaces)


def dev_heads(dev_root: str | Path = "/dev", nbytes: int = PROBE_BYTES) -> HeadReader:
    """Read a namespace's first blocks from `<dev_root>/<name>.head` (a capture) or
    `<dev_root>/<name>` (the device itself, O_DIRECT so the page cache cannot hide
    a signature someone just wrote)."""
    root = Path(dev_root)

    def read(name: str) -> bytes:
        captured = root / f"{name}.head"
        if captured.is_file():
            return captured.read_bytes()[:nbytes]
        if not os.path.exists(root / name):
            raise FileNotFoundError(2, f"no {root / name}")
        return read_head(str(root / name), nbytes)

    return read
