"""Device safety: refuse any device that may hold someone's data.

Writing to the wrong disk destroys data, so before the NVMe engine opens a
block device it must have no partitions, no mounted filesystem, no holders
(dm/md/bcache stacked on it), not be active swap, and carry no filesystem or
partition-table signature in its first blocks. `force` overrides only the
signature check (a user who knows the old content is garbage); never the rest.

`probe_signature` is pure so that discovery can apply it to bytes it read.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from pathlib import Path

from memstrata.node.header import is_memstrata



class DeviceUnsafeError(Exception):
    """Refusal to write a device that may hold someone's data; names the device and the reason."""

    def __init__(self, device: str, reason: str) -> None:
        self.device = device
        self.reason = reason
        super().__init__(f"{device}: refusing to use it: {reason}")


# Enough for every probe below (btrfs's superblock sits at 64 KiB).
PROBE_BYTES = 128 << 10


def _at(head: bytes, offset: int, magic: bytes) -> bool:
    return head[offset : offset + len(magic)] == magic


def _ext_kind(head: bytes) -> str | None:
    sb = 1024
    if len(head) < sb + 104 or head[sb + 56 : sb + 58] != b"\x53\xef":
        return None
    compat, incompat, ro_compat = struct.unpack_from("<III", head, sb + 92)
    # ext4-only features: extents, 64bit, flex_bg, huge_file, gdt_csum, dir_nlink, extra_isize, metadata_csum
    if incompat & (0x40 | 0x80 | 0x200) or ro_compat & (0x8 | 0x10 | 0x20 | 0x40 | 0x400):
        return "ext4"
    return "ext3" if compat & 0x4 else "ext2"


def _mbr_kind(head: bytes) -> str | None:
    if len(head) < 512 or head[510:512] != b"\x55\xaa":
        return None
    if _at(head, 54, b"FAT") or _at(head, 82, b"FAT32"):
        return "vfat"
    if _at(head, 3, b"NTFS    "):
        return "ntfs"
    if _at(head, 3, b"EXFAT   "):
        return "exfat"
    return "dos (MBR partition table)"


def probe_signature(head: bytes) -> str | None:
    """Name of the filesystem, partition table or volume found in `head`.

    None for blank (all-zero) space and for memstrata's own header. Only
    probes whose offsets lie inside `head` are applied, so pass PROBE_BYTES.
    """
    head = bytes(head)
    if is_memstrata(head):
        return None
    for offset in (512, 4096):  # GPT header at LBA 1 for 512 B and 4 KiB sectors
        if _at(head, offset, b"EFI PART"):
            return "gpt (GPT partition table)"
    for offset in (0, 512, 1024, 1536):
        if _at(head, offset, b"LABELONE") and _at(head, offset + 24, b"LVM2 "):
            return "LVM2_member"
    simple = [
        (0, b"LUKS\xba\xbe", "crypto_LUKS"),
        (0, b"SKUL\xba\xbe", "crypto_LUKS"),
        (0, b"XFSB", "xfs"),
        (0, b"hsqs", "squashfs"),
        (65536 + 64, b"_BHRfS_M", "btrfs"),
        (1024, b"\x10\x20\xf5\xf2", "f2fs"),
        (32769, b"CD001", "iso9660"),
        (0, b"\xfc\x4e\x2b\xa9", "linux_raid_member"),  # md superblock 1.1
        (4096, b"\xfc\x4e\x2b\xa9", "linux_raid_member"),  # md superblock 1.2
    ]
    for offset, magic, name in simple:
        if name and _at(head, offset, magic):
            return name
    for page in (4096, 8192, 16384, 65536):
        if _at(head, page - 10, b"SWAPSPACE2") or _at(head, page - 10, b"SWAP-SPACE"):
            return "swap"
    if _at(head, 4096 + 24, bytes.fromhex("c68573f64e1a45ca8265f57f48ba6d81")):
        return "bcache"
    return _ext_kind(head) or _mbr_kind(head)


def read_head(path: str, nbytes: int = PROBE_BYTES) -> bytes:
    """First `nbytes` of `path`, read with O_DIRECT where possible so that the
    page cache cannot hide what another writer put there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        direct = True
    except OSError:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        direct = False
    try:
        if not direct:
            return os.pread(fd, nbytes, 0)
        buf = mmap.mmap(-1, nbytes)
        try:
            got = os.preadv(fd, [buf], 0)
            return bytes(buf[:got])
        finally:
            buf.close()
    finally:
        os.close(fd)


def _block_name(rdev: int, sysfs_root: str) -> str:
    link = Path(sysfs_root, "dev", "block", f"{os.major(rdev)}:{os.minor(rdev)}")
    return Path(os.readlink(link)).name if link.is_symlink() else ""


def _partitions(block_dir: Path) -> list[str]:
    try:
        children = list(block_dir.iterdir())
    except OSError:
        return []
    return sorted(c.name for c in children if (c / "partition").is_file())


def _mounts(proc_mounts: str) -> list[tuple[str, str]]:
    try:
        text = Path(proc_mounts).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out.append((parts[0], parts[1].replace("\\040", " ")))
    return out


def sysfs_problems(name: str, *, sysfs_root: str = "/sys", proc_mounts: str = "/proc/mounts",
                   proc_swaps: str = "/proc/swaps") -> list[str]:
    """Reasons (possibly none) why block device `name` (e.g. "nvme0n1", "loop3")
    is not free for memstrata, read from a sysfs tree and a mounts table."""
    block = Path(sysfs_root, "class", "block", name)
    if not block.exists():
        return [f"no such block device in {sysfs_root}/class/block"]
    problems = []
    if (block / "partition").is_file():
        problems.append("is itself a partition")
    parts = _partitions(block)
    if parts:
        problems.append(f"has partitions ({', '.join(parts)})")
    try:
        holders = sorted(p.name for p in (block / "holders").iterdir())
    except OSError:
        holders = []
    if holders:
        problems.append(f"held by {', '.join(holders)}")
    names = {name, *parts}
    for source, target in _mounts(proc_mounts):
        if not source.startswith("/dev/"):
            continue
        # /dev/disk/by-* and /dev/mapper links name the device only after resolving.
        if {os.path.basename(source), os.path.basename(os.path.realpath(source))} & names:
            problems.append(f"mounted at {target} ({source})")
    for source, _ in _mounts(proc_swaps)[1:]:
        if os.path.basename(source) in names:
            problems.append(f"active swap ({source})")
    return problems


def check_device(path: str, *, sysfs_root: str = "/sys", proc_mounts: str = "/proc/mounts",
                 force: bool = False) -> None:
    """Raise DeviceUnsafeError naming `path` and the reason when it is not safe to write.

    Block devices get the sysfs checks (partitions, holders, mounts, swap) and
    the signature check; regular files only the signature check. `force`
    skips only the signature check.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DeviceUnsafeError(path, f"cannot stat: {exc.strerror}") from exc
    if stat.S_ISBLK(st.st_mode):
        name = _block_name(st.st_rdev, sysfs_root) or os.path.basename(os.path.realpath(path))
        problems = sysfs_problems(name, sysfs_root=sysfs_root, proc_mounts=proc_mounts)
        if problems:
            raise DeviceUnsafeError(path, "; ".join(problems))
    elif not stat.S_ISREG(st.st_mode):
        raise DeviceUnsafeError(path, "neither a block device nor a regular file")
    if force:
        return
    try:
        head = read_head(path)
    except OSError as exc:
        raise DeviceUnsafeError(path, f"cannot read its first blocks: {exc.strerror}") from exc
    kind = probe_signature(head)
    if kind:
        raise DeviceUnsafeError(path, f"carries a {kind} signature (pass force to overwrite it)")
