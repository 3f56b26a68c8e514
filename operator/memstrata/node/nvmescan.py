"""NVMe controllers and namespaces from sysfs, and whether each namespace is free.

Whether a namespace is free is `memstrata.node.safety.namespace_problems`,
the same rule the raw-NVMe engine applies before it opens a device; this
module only gathers its facts: the namespace's sysfs entry, the mount table,
/proc/swaps and its first blocks. The first blocks come from a `HeadReader`,
so tests feed captured bytes and the agent reads the real device; everything
else is parsing.

`free` is that rule alone. A namespace whose memstrata header says a finished
job's data may still be on it is free too (it is memstrata's capacity, which the
planner counts), but the device plugin lists it Unhealthy until the node agent
has scrubbed it (memstrata.node.scrub, memstrata.nodeagent.scrubber).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from memstrata.api.inventory import NvmeController, NvmeNamespace
from memstrata.node.safety import (
    Mount, Problem, block_state, describe, namespace_problems,
)
from memstrata.node.sysfs import SysfsError, SysfsTree

# Returns the first bytes of /dev/<name>; raises OSError when it cannot.
HeadReader = Callable[[str], bytes]
SECTOR = 512  # sysfs `size` is in 512-byte sectors whatever the logical block size
# Per-path nodes of a multipath namespace (nvme<subsys>c<ctrl>n<ns>) have no /dev
# entry to open; the kernel marks them hidden, older kernels do not list them.
_PATH_NODE = re.compile(r"^nvme\d+c\d+n\d+$")
_NAMESPACE = re.compile(r"^nvme\d+n\d+$")
_CONTROLLER = re.compile(r"^nvme\d+$")


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


def problems(tree: SysfsTree, name: str, heads: HeadReader, mounts: Sequence[Mount],
             swaps: Sequence[str]) -> list[Problem]:
    """Why block device `name` (under the tree's `block/`) is not free: the one safety rule, never forced."""
    try:
        head: bytes | OSError = heads(name)
    except OSError as exc:  # unknown content is treated as someone's data: safety over capacity
        head = exc
    return namespace_problems(head=head, block=block_state(tree, f"block/{name}"), mounts=mounts, swaps=swaps)


def geometry(tree: SysfsTree, name: str) -> tuple[int, int]:
    """Block device `name`'s size in 512-byte sectors and its logical block size; SysfsError naming a bad one."""
    base = f"block/{name}"
    sectors = tree.int(f"{base}/size")
    lbs = tree.int(f"{base}/queue/logical_block_size")
    if sectors is None or sectors < 0:
        raise SysfsError(tree.path(f"{base}/size"), f"size must be >= 0 sectors, found {sectors}")
    if lbs is None or lbs <= 0 or lbs & (lbs - 1):
        raise SysfsError(tree.path(f"{base}/queue/logical_block_size"),
                         f"logical block size must be a power of two, found {lbs}")
    return sectors, lbs


def namespace(tree: SysfsTree, name: str, heads: HeadReader, mounts: Sequence[Mount], swaps: Sequence[str],
              numa_of: dict[str, int | None]) -> NvmeNamespace:
    base = f"block/{name}"
    nsid = tree.int(f"{base}/nsid")
    if nsid is None or nsid < 1:
        raise SysfsError(tree.path(f"{base}/nsid"), f"namespace id must be >= 1, found {nsid}")
    sectors, lbs = geometry(tree, name)
    found = problems(tree, name, heads, mounts, swaps)
    reasons = [describe(found)] if found else []
    if sectors == 0:
        reasons.append("size is 0")
    ctrl = _controller_of(tree, name)
    return NvmeNamespace(
        name=name, controller=ctrl, nsid=nsid, size_bytes=sectors * SECTOR, logical_block_size=lbs,
        wwid=tree.text(f"{base}/wwid", required=False) or None, numa_node=numa_of.get(ctrl),
        free=not reasons, reason="; ".join(reasons) or None,
    )


def namespaces(tree: SysfsTree, heads: HeadReader, mounts: Sequence[Mount], swaps: Sequence[str],
               ctrls: list[NvmeController]) -> list[NvmeNamespace]:
    numa_of = {c.name: c.numa_node for c in ctrls}
    return [namespace(tree, name, heads, mounts, swaps, numa_of) for name in namespace_names(tree)]
