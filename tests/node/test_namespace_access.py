"""The node agent offers a namespace only if the training container's user can open it: the kernel's owner,
group, others permission check, applied to the device node's ownership."""
from __future__ import annotations

import pytest

from memstrata.api.inventory import NodeInventory, NvmeNamespace
from memstrata.api.podidentity import DISK_GID, RUNTIME_UID, TrainingIdentity, parse_device_gid
from memstrata.node.access import open_refusal, vet_access

POD = TrainingIdentity()  # uid 1000, group 1000, supplementary group disk (6)


@pytest.mark.parametrize(("ownership", "who", "opens"), [
    ((0, DISK_GID, 0o660), POD, True),                                  # what udev makes: root:disk 0660
    ((0, 0, 0o600), POD, False),                                        # a host without udev: root:root 0600
    ((0, DISK_GID, 0o640), POD, False),                                 # readable, not writable
    ((0, 0, 0o666), POD, True),                                         # others may
    ((RUNTIME_UID, 0, 0o600), POD, True),                               # the pod's user owns it
    ((RUNTIME_UID, DISK_GID, 0o066), POD, False),                       # the owner's bits decide for the owner
    ((0, 44, 0o660), POD, False),                                       # another group
    ((0, 44, 0o660), TrainingIdentity(device_gid=44), True),            # ... which the chart names
    ((0, DISK_GID, 0o660), TrainingIdentity(device_gid=None), False),   # no supplementary group given
])
def test_the_permission_check_is_the_kernels(ownership: tuple[int, int, int], who: TrainingIdentity,
                                             opens: bool) -> None:
    assert (open_refusal("nvme0n1", ownership, who) is None) is opens


def test_a_refusal_names_the_device_its_ownership_the_pods_identity_and_the_fix() -> None:
    why = open_refusal("loop0", (0, 0, 0o600), POD)
    assert why is not None
    assert why.startswith("/dev/loop0 is owned by 0:0 with mode 0600: the training container (uid 1000, groups 1000,6)")
    assert "root:disk 0660" in why and "trainingPod.deviceGroup" in why


def test_only_free_namespaces_the_pod_cannot_open_are_withdrawn() -> None:
    inv = NodeInventory(nvme_namespaces=[
        NvmeNamespace(name="nvme0n1", size_bytes=1 << 30, free=True),
        NvmeNamespace(name="nvme1n1", size_bytes=1 << 30, free=True),
        NvmeNamespace(name="nvme2n1", size_bytes=1 << 30, free=False, reason="mounted at /data"),
        NvmeNamespace(name="nvme3n1", size_bytes=1 << 30, free=True),  # no device node to look at (a capture)
    ])
    owners = {"nvme0n1": (0, DISK_GID, 0o660), "nvme1n1": (0, 0, 0o600), "nvme2n1": (0, 0, 0o600)}
    vetted = vet_access(inv, owners.get, POD)
    assert [(n.name, n.free) for n in vetted.nvme_namespaces] == [
        ("nvme0n1", True), ("nvme1n1", False), ("nvme2n1", False), ("nvme3n1", True)]
    assert vetted.nvme_namespaces[1].reason is not None and "/dev/nvme1n1" in vetted.nvme_namespaces[1].reason
    assert vetted.nvme_namespaces[2].reason == "mounted at /data"  # its own reason stands
    assert [n.name for n in vetted.free_namespaces] == ["nvme0n1", "nvme3n1"]


@pytest.mark.parametrize(("text", "gid"), [("6", 6), (" 44 ", 44), ("none", None), ("None", None), ("", None)])
def test_the_device_group_flag(text: str, gid: int | None) -> None:
    assert parse_device_gid(text) == gid


@pytest.mark.parametrize(("text", "problem"), [("disk", "expected a numeric group id or 'none'"),
                                               ("-6", "expected a numeric group id or 'none'"),
                                               ("0", "root's group"), ("4294967296", "from 1 to 2147483647")])
def test_a_bad_device_group_is_refused_naming_it(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match="device group") as err:
        parse_device_gid(text)
    assert problem in str(err.value)
