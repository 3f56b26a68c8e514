"""Loop devices advertised as namespaces: the node agent's opt-in for test and development clusters.

    memstrata nodeagent --loop-namespaces loop3,loop4

A node without NVMe (a VM, a CI runner) can still run the whole path, planner,
device plugin, scrubber and raw-NVMe engine, over loop devices that someone
attached to files on the node's filesystem (`losetup -f --show FILE`). Only the
devices named are considered, never every loop device: a loop device may be
someone's disk image. Each becomes an `NvmeNamespace` of kind `loop`, so that the
inventory, the Node's labels (memstrata.api.inventory.LABEL_LOOP_NAMESPACES) and
anything reading them tell it from NVMe; nothing about it is NVMe (no controller,
NUMA node or WWID, nsid 1).

Whether one is free is the same rule as for NVMe (`memstrata.node.nvmescan.problems`,
i.e. memstrata.node.safety), plus two facts only a loop device has:

- detached (no `loop/backing_file`: no file behind it, size 0). Listed, not free,
  rather than an error: a reboot detaches every loop device, and an agent that
  refused to start, or kept its last inventory, would take the node's other strata
  down with it or offer a device with nothing behind it. Re-attached, it is free
  again at the next scan;
- backed by a block device (`losetup /dev/sdb`): writing it writes that device,
  whose partitions, mounts and holders the loop device's sysfs entry does not show;
- sharing its backing file with another loop device (`losetup -f FILE` attaches a file
  that is attached already, without a word): two jobs would write over each other, or
  over what the other device's mount holds.

A loop device the kernel no longer has (a `losetup -f` that made loop8 does not survive
a reboot) is listed, not free, like a detached one. A name that is not `loop<N>` is an
error naming it.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from memstrata.api.inventory import NvmeNamespace
from memstrata.node.nvmescan import SECTOR, HeadReader, geometry, problems
from memstrata.node.safety import Mount, describe
from memstrata.node.sysfs import SysfsError, SysfsTree

LOOP_NAME = re.compile(r"^loop[0-9]+$")
DETACHED = "detached: no backing file (attach one with losetup)"
MISSING = "no such loop device (attach a file with `losetup -f --show FILE`)"


def backing_files(tree: SysfsTree) -> dict[str, str]:
    """Every attached loop device's backing file, named or not (sysfs only; no device is opened)."""
    out = {}
    for entry in tree.entries("block", "loop*"):
        backing = tree.text(f"block/{entry}/loop/backing_file", required=False)
        if backing and LOOP_NAME.match(entry):
            out[entry] = backing
    return out


def loop_namespace(tree: SysfsTree, name: str, heads: HeadReader, mounts: Sequence[Mount],
                   swaps: Sequence[str], backings: dict[str, str] | None = None) -> NvmeNamespace:
    """Loop device `name` (`loop3`) as a namespace; raises SysfsError naming it when it is not a loop device
    name. `backings`: every loop device's backing file (backing_files), to find two sharing one."""
    base = f"block/{name}"
    if not LOOP_NAME.match(name):
        raise SysfsError(tree.path(base), f"{name!r} is not a loop device name (loop<N>, e.g. loop3)")
    if not tree.exists(base):
        return NvmeNamespace(name=name, kind="loop", nsid=1, size_bytes=0, free=False, reason=MISSING)
    sectors, lbs = geometry(tree, name)
    # The kernel adds loop/ when a file is attached and removes it on detach.
    backing = tree.text(f"{base}/loop/backing_file", required=False)
    found = problems(tree, name, heads, mounts, swaps)
    reasons = [describe(found)] if found else []
    sharing = sorted(other for other, b in (backings or {}).items() if b == backing and other != name)
    if not backing:
        reasons.append(DETACHED)
    elif backing.startswith("/dev/"):
        reasons.append(f"backed by the block device {backing}, not a file: writing it would write that device")
    elif sharing:
        reasons.append(f"shares its backing file {backing} with {', '.join(sharing)}")
    elif sectors == 0:
        reasons.append("size is 0")
    return NvmeNamespace(name=name, kind="loop", nsid=1, size_bytes=sectors * SECTOR, logical_block_size=lbs,
                         free=not reasons, reason="; ".join(reasons) or None)


def loop_namespaces(tree: SysfsTree, names: Sequence[str], heads: HeadReader, mounts: Sequence[Mount],
                    swaps: Sequence[str]) -> list[NvmeNamespace]:
    """The named loop devices, in the order named (each once)."""
    backings = backing_files(tree)
    return [loop_namespace(tree, name, heads, mounts, swaps, backings) for name in dict.fromkeys(names)]
