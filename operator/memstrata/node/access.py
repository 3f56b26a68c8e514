"""Whether the training container can open a namespace's device node: a node without udev's rules (or with
other rules) leaves block devices root:root 0600, and a job handed such a namespace would fail at its first
read. The node agent does not offer what the training user cannot open, and says why in the inventory."""
from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from memstrata.api.inventory import NodeInventory, NvmeNamespace
from memstrata.api.podidentity import TrainingIdentity

# (owner uid, owner gid, permission bits) of a device node, or None where there is no node to look at (a captured
# tree's `<name>.head`): no verdict then.
Ownership = tuple[int, int, int]
OwnershipReader = Callable[[str], "Ownership | None"]
READ_WRITE = stat.S_IRUSR | stat.S_IWUSR


def open_refusal(name: str, ownership: Ownership, who: TrainingIdentity) -> str | None:
    """Why `who` cannot open /dev/`name` for reading and writing, as the kernel's permission check decides
    (the owner's bits for its owner, else the group's for a member, else the others'); None if it can."""
    uid, gid, mode = ownership
    if uid == who.uid:
        bits = (mode >> 6) & 0o7
    elif gid in who.groups:
        bits = (mode >> 3) & 0o7
    else:
        bits = mode & 0o7
    if bits & 0o6 == 0o6:
        return None
    hint = (f"give the node's block devices group {who.device_gid} with mode 0660 (udev's default rules make them "
            "root:disk 0660), or set the chart's trainingPod.deviceGroup to the group that owns them"
            if who.device_gid is not None else "set the chart's trainingPod.deviceGroup to the group that owns them")
    return (f"/dev/{name} is owned by {uid}:{gid} with mode {mode:04o}: the training container ({who.describe()}) "
            f"cannot open it for reading and writing; {hint}")


def vet_access(inventory: NodeInventory, ownership_of: OwnershipReader, who: TrainingIdentity) -> NodeInventory:
    """The inventory with every free namespace `who` cannot open marked not free, with the reason."""
    def vetted(ns: NvmeNamespace) -> NvmeNamespace:
        owned = ownership_of(ns.name) if ns.free else None
        why = open_refusal(ns.name, owned, who) if owned is not None else None
        return ns if why is None else ns.model_copy(update={"free": False, "reason": why})

    return inventory.model_copy(update={"nvme_namespaces": [vetted(ns) for ns in inventory.nvme_namespaces]})


def dev_ownership(dev_root: str | Path = "/dev") -> OwnershipReader:
    """Ownership of `<dev_root>/<name>`, the device node itself (not a captured `<name>.head`)."""
    root = Path(dev_root)

    def read(name: str) -> Ownership | None:
        try:
            st = os.stat(root / name)
        except FileNotFoundError:
            return None
        if not stat.S_ISBLK(st.st_mode):
            return None
        return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)

    return read
