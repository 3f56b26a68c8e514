"""Who the training container runs as, in one place: the operator's pod security context uses it, and the node
agent checks with it that this user can open a namespace before offering the namespace to a job."""
from __future__ import annotations

from dataclasses import dataclass

RUNTIME_UID = 1000  # the runtime image's non-root user and group (docker/runtime.Dockerfile)
# The `disk` group of Debian, Ubuntu, RHEL, Fedora, SUSE and Alpine: udev makes every block device,
# NVMe namespaces included, root:disk 0660, and the device plugin passes the node's device through as is.
DISK_GID = 6


def parse_device_gid(text: str) -> int | None:
    """The `--training-device-gid` flag of the operator and the node agent: a numeric group id, or `none`
    (nodes whose containerd sets device_ownership_from_security_context hand devices to the pod's user)."""
    value = text.strip().lower()
    if value in ("none", ""):
        return None
    if not value.isdigit():
        raise ValueError(f"device group {text!r}: expected a numeric group id or 'none'")
    return checked_device_gid(int(value))


def checked_device_gid(gid: int) -> int:
    """`gid`, or ValueError naming it where it cannot be the training pods' device group."""
    if not 0 < gid < 1 << 31:
        raise ValueError(f"device group {gid}: expected a group id from 1 to 2147483647 "
                         "(0, root's group, would defeat runAsNonRoot's purpose)")
    return gid


@dataclass(frozen=True)
class TrainingIdentity:
    """The training container's user, primary group and supplementary groups."""

    uid: int = RUNTIME_UID
    gid: int = RUNTIME_UID
    device_gid: int | None = DISK_GID

    @property
    def groups(self) -> tuple[int, ...]:
        return (self.gid,) if self.device_gid is None else (self.gid, self.device_gid)

    def describe(self) -> str:
        return f"uid {self.uid}, groups {','.join(map(str, self.groups))}"
