"""NVMe controllers and namespaces from sysfs, and whether each namespace is free.

A namespace is free only when nothing else can be using it: no partitions,
no holders (device-mapper, md, bcache stacked on it), no mount of it or of a
partition, not read-only, and no filesystem, partition-table or volume
signature in its first blocks (memstrata's own header does not count). The
first blocks come from a `HeadReader`, so tests feed captured bytes and the
agent reads the real device; everything else is parsing.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from memstrata.api.inventory import NvmeController, NvmeNamespace
from memstrata.node.sysfs import SysfsError, SysfsTree
from memstrata.node.safety import probe_signature

# Returns the first bytes of /dev/<name>; raises OSError when it cannot.
HeadReader = Callable[[str], bytes]
SECTOR = 512  # sysfs `size` is in 512-byte sectors whatever the logical block size
# Per-path nodes of a multipath namespace (nvme<subsys>c<ctrl>n<ns>) have no /dev
# entry to open; the kernel marks them hidden, older kernels do not list them.
_PATH_NODE = re.compile(r"^nvme\d+c\d+n\d+$")
_NAMESPACE = re.compile(r"^nvme\d+n\d+$")
_CONTROLLER = re.compile(r"^nvme\d+$")
_DEV = re.compile(r"^\d+:\d+$")


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """(what, mountpoint) pairs from /proc/mounts or /proc/self/mountinfo text.

    `what` is the major:minor from mountinfo (exact, whatever name the device
    was mounted by) or the source device path from /proc/mounts.
    """
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and _DEV.match(fields[2]):  # mountinfo: id parent maj:min root mountpoint ...
            out.append((fields[2], fields[4].replace("\\040", " ")))
        elif len(fields) >= 2:
            out.append((fields[0], fields[1].replace("\\040", " ")))
    return out


def _numa(tree: SysfsTree, ctrl: str) -> int | None:
    # The controller class device carries numa_node on current kernels; the PCI
    # function behind it always does. -1 means the platform did not say.
    for rel in (f"class/nvme/{ctrl}/numa_node", f"class/nvme/{ctrl}/device/numa_node"):
        value = tree.int(rel, required=False)
        if value is not None:
            return value if value >= 0 else None
    return None


def controllers(tree: SysfsTree) -> list[NvmeController]:
    out = []
    for name in tree.entries("class/nvme", "nvme*"):
        if not _CONTROLLER.match(name):
            continue
        base = f"class/nvme/{name}"
        out.append(NvmeController(
            name=name,
            model=tree.text(f"{base}/model") or "",
            serial=tree.text(f"{base}/serial") or "",
            firmware=tree.text(f"{base}/firmware_rev", required=False) or "",
            transport=tree.text(f"{base}/transport", required=False) or "",
            numa_node=_numa(tree, name),
        ))
    return out


def _controller_of(tree: SysfsTree, name: str) -> str:
    """The controller a namespace is reached through.

    Without native multipath the namespace's block device sits in its
    controller's directory. With it (Debian's default), the block device is
    the namespace head under nvme-subsystem, and the controller's directory
    holds the per-path node nvme<S>c<C>n<N> of head nvme<S>n<N>.
    """
    subsys, head = re.fullmatch(r"nvme(\d+)n(\d+)", name).groups()  # type: ignore[union-attr]
    path_node = re.compile(rf"^nvme{subsys}c\d+n{head}$")
    for ctrl in tree.entries("class/nvme", "nvme*"):
        entries = tree.entries(f"class/nvme/{ctrl}", "nvme*")
        if name in entries or any(path_node.match(e) for e in entries):
            return ctrl
    return ""


def namespace_names(tree: SysfsTree) -> list[str]:
    """Visible namespace block devices (hidden per-path nodes left out)."""
    names = []
    for name in tree.entries("block", "nvme*"):
        if _PATH_NODE.match(name) or tree.text(f"block/{name}/hidden", required=False) == "1":
            continue
        if _NAMESPACE.match(name):
            names.append(name)
    return names


def _partitions(tree: SysfsTree, name: str) -> list[str]:
    return [p for p in tree.entries(f"block/{name}", f"{name}*") if tree.exists(f"block/{name}/{p}/partition")]


def busy_reasons(tree: SysfsTree, name: str, mounts: list[tuple[str, str]]) -> list[str]:
    """Why another user may own namespace `name`, from sysfs and the mount table alone."""
    base = f"block/{name}"
    reasons = []
    if tree.int(f"{base}/ro", required=False) == 1:
        reasons.append("read-only")
    parts = _partitions(tree, name)
    if parts:
        reasons.append(f"has partitions ({', '.join(parts)})")
    holders = tree.entries(f"{base}/holders")
    if holders:
        reasons.append(f"held by {', '.join(holders)}")
    names = {name, *parts}
    devs = {tree.text(f"{base}/dev", required=False)} | {tree.text(f"{base}/{p}/dev", required=False) for p in parts}
    devs.discard(None)
    for what, target in mounts:
        if what in devs or (what.startswith("/dev/") and Path(what).name in names):
            reasons.append(f"mounted at {target}")
    return reasons


def signature_reason(name: str, heads: HeadReader) -> str | None:
    """Why the first blocks forbid using the namespace: a foreign signature, or unreadable."""
    try:
        head = heads(name)
    except OSError as exc:
        # Unknown content is treated as someone's data: safety over capacity.
        return f"first blocks unreadable ({exc.strerror or exc})"
    kind = probe_signature(head)
    return f"foreign signature: {kind}" if kind else None


def namespace(tree: SysfsTree, name: str, heads: HeadReader, mounts: list[tuple[str, str]],
              numa_of: dict[str, int | None]) -> NvmeNamespace:
    base = f"block/{name}"
    nsid = tree.int(f"{base}/nsid")
    if nsid is None or nsid < 1:
        raise SysfsError(tree.path(f"{base}/nsid"), f"namespace id must be >= 1, found {nsid}")
    sectors = tree.int(f"{base}/size")
    lbs = tree.int(f"{base}/queue/logical_block_size")
    if sectors is None or sectors < 0:
        raise SysfsError(tree.path(f"{base}/size"), f"size must be >= 0 sectors, found {sectors}")
    if lbs is None or lbs <= 0 or lbs & (lbs - 1):
        raise SysfsError(tree.path(f"{base}/queue/logical_block_size"),
                         f"logical block size must be a power of two, found {lbs}")
    reasons = busy_reasons(tree, name, mounts)
    if sectors == 0:
        reasons.append("size is 0")
    if not reasons:  # only read a device nothing else claims
        sig = signature_reason(name, heads)
        if sig:
            reasons.append(sig)
    ctrl = _controller_of(tree, name)
    return NvmeNamespace(
        name=name, controller=ctrl, nsid=nsid, size_bytes=sectors * SECTOR, logical_block_size=lbs,
        wwid=tree.text(f"{base}/wwid", required=False) or None, numa_node=numa_of.get(ctrl),
        free=not reasons, reason="; ".join(reasons) or None,
    )


def namespaces(tree: SysfsTree, heads: HeadReader, mounts_text: str,
               ctrls: list[NvmeController]) -> list[NvmeNamespace]:
    mounts = parse_mounts(mounts_text)
    numa_of = {c.name: c.numa_node for c in ctrls}
    return [namespace(tree, name, heads, mounts, numa_of) for name in namespace_names(tree)]
