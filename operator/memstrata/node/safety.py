"""Namespace safety: the one rule for whether memstrata may write a block device.

Writing to the wrong disk destroys data. A device is unsafe when any of these
holds, and `namespace_problems` names every one that does:

- its first blocks carry a filesystem, partition-table or volume signature,
  or cannot be read (unknown content is someone's data). Checked first and
  always, whatever else the blocks hold: a leftover memstrata header does not
  hide a partition table written after it (sgdisk keeps the boot-code bytes);
- it is a partition, or has partitions;
- something is stacked on it or on a partition (dm, md, bcache: holders);
- it or one of its partitions is mounted, or is an active swap area;
- it is read-only.

`force` overrides only the signature check, never the rest. The node agent's
discovery (`memstrata.node.nvmescan`) and the raw-NVMe engine's pre-open check
(`check_device`, via memstrata.runtime.strata.nvme) both call
`namespace_problems`; they differ only in where the facts come from (a sysfs
capture or /sys, a mount table, /proc/swaps, the first blocks). Everything but
the readers at the bottom is pure.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from memstrata.node.sysfs import SysfsError, SysfsTree


class DeviceUnsafeError(Exception):
    """Refusal to write a device that may hold someone's data; names the device and the reason."""

    def __init__(self, device: str, reason: str) -> None:
        self.device = device
        self.reason = reason
        super().__init__(f"{device}: refusing to use it: {reason}")

    def __reduce__(self) -> tuple[Callable[..., DeviceUnsafeError], tuple[object, ...]]:
        # Picklable (a refusal raised in a worker process reaches its parent): rebuilt from both fields.
        return type(self), (self.device, self.reason)


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


_SIMPLE = [
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


def probe_signature(head: bytes) -> str | None:
    """Name of the filesystem, partition table or volume found in `head`; None for none.

    Every probe runs whatever the first bytes are: memstrata's own header
    matches none of them, so it needs no exception, and one left behind
    cannot hide a signature written over the blocks after it. Only probes
    whose offsets lie inside `head` can match, so pass PROBE_BYTES.
    """
    head = bytes(head)
    for offset in (512, 4096):  # GPT header at LBA 1 for 512 B and 4 KiB sectors
        if _at(head, offset, b"EFI PART"):
            return "gpt (GPT partition table)"
    for offset in (0, 512, 1024, 1536):
        if _at(head, offset, b"LABELONE") and _at(head, offset + 24, b"LVM2 "):
            return "LVM2_member"
    for offset, magic, name in _SIMPLE:
        if _at(head, offset, magic):
            return name
    for page in (4096, 8192, 16384, 65536):
        if _at(head, page - 10, b"SWAPSPACE2") or _at(head, page - 10, b"SWAP-SPACE"):
            return "swap"
    if _at(head, 4096 + 24, bytes.fromhex("c68573f64e1a45ca8265f57f48ba6d81")):
        return "bcache"
    return _ext_kind(head) or _mbr_kind(head)


# -- the facts ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockState:
    """What sysfs says about one block device and its partitions."""

    name: str
    numbers: frozenset[str] = frozenset()  # "major:minor" of the device and of each partition
    partitions: tuple[str, ...] = ()
    holders: tuple[str, ...] = ()  # stacked on the device or on one of its partitions
    read_only: bool = False
    is_partition: bool = False


@dataclass(frozen=True)
class Mount:
    """One line of a mount table."""

    target: str
    number: str | None = None  # "major:minor" (mountinfo: exact, whatever name it was mounted by)
    source: str | None = None  # what was mounted, e.g. /dev/nvme0n1p2 (btrfs shows only this one)
    fstype: str = ""


ProblemKind = Literal["signature", "partition", "holders", "mounted", "swap", "read-only"]


@dataclass(frozen=True)
class Problem:
    """One reason a device is unsafe; `reason` is what users read (inventory, errors)."""

    kind: ProblemKind
    reason: str


def _unescape(field: str) -> str:
    # The kernel octal-escapes space, tab, newline and backslash in mount and swap paths.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mounts(text: str) -> list[Mount]:
    """/proc/self/mountinfo or /proc/mounts text as Mounts (the format is told apart per line)."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and _is_number(fields[2]):  # mountinfo: id parent maj:min root target ... - fs source
            tail = fields[fields.index("-", 6) + 1 :] if "-" in fields[6:] else []
            out.append(Mount(target=_unescape(fields[4]), number=fields[2],
                             source=_unescape(tail[1]) if len(tail) > 1 else None, fstype=tail[0] if tail else ""))
        elif len(fields) >= 3:  # /proc/mounts: source target fstype options ...
            out.append(Mount(target=_unescape(fields[1]), source=_unescape(fields[0]), fstype=fields[2]))
    return out


def parse_swaps(text: str) -> list[str]:
    """Paths of the active swap areas in /proc/swaps text (its first line is a header)."""
    lines = text.splitlines()
    return [_unescape(line.split()[0]) for line in lines[1:] if line.split()]


def _is_number(field: str) -> bool:
    major, sep, minor = field.partition(":")
    return bool(sep) and major.isdigit() and minor.isdigit()


# -- the rule ----------------------------------------------------------------------------------------
def signature_problem(head: bytes | OSError) -> Problem | None:
    """A foreign signature in the first blocks, or the first blocks unreadable."""
    if isinstance(head, OSError):
        return Problem("signature", f"first blocks unreadable ({head.strerror or head})")
    kind = probe_signature(head)
    return Problem("signature", f"foreign signature: {kind}") if kind else None


def namespace_problems(*, head: bytes | OSError | None, block: BlockState | None, mounts: Sequence[Mount],
                       swaps: Sequence[str], force: bool = False) -> list[Problem]:
    """Every reason memstrata must not write this device; empty when it is free.

    `head` is its first PROBE_BYTES (or the error reading them; None only with
    `force`, which skips the signature check and nothing else). `block` is
    None for a regular file, which has no sysfs entry, mounts or swap of its own.
    """
    problems: list[Problem] = []
    if not force:
        sig = signature_problem(head if head is not None else OSError("not read"))
        if sig is not None:
            problems.append(sig)
    if block is None:
        return problems
    names = {block.name, *block.partitions}
    if block.is_partition:
        problems.append(Problem("partition", "is itself a partition"))
    if block.partitions:
        problems.append(Problem("partition", f"has partitions ({', '.join(block.partitions)})"))
    if block.holders:
        problems.append(Problem("holders", f"held by {', '.join(block.holders)}"))
    for target in _unique(m.target for m in mounts if _names_device(m, block.numbers, names)):
        problems.append(Problem("mounted", f"mounted at {target}"))
    for swap in _unique(s for s in swaps if os.path.basename(s) in names):
        problems.append(Problem("swap", f"active swap ({swap})"))
    if block.read_only:
        problems.append(Problem("read-only", "read-only"))
    return problems


def _names_device(mount: Mount, numbers: frozenset[str], names: set[str]) -> bool:
    if mount.number is not None and mount.number in numbers:
        return True
    return bool(mount.source and mount.source.startswith("/dev/") and os.path.basename(mount.source) in names)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def describe(problems: Sequence[Problem]) -> str:
    """The problems as one line, the way inventories and errors show them."""
    return "; ".join(p.reason for p in problems)


# -- readers (the edges) -----------------------------------------------------------------------------
def block_state(tree: SysfsTree, rel: str) -> BlockState:
    """The facts about the block device whose sysfs directory is `rel` (`block/nvme0n1`,
    `class/block/loop3`); raises SysfsError naming a garbled attribute."""
    name = Path(rel).name
    parts = tuple(p for p in tree.entries(rel) if tree.exists(f"{rel}/{p}/partition"))
    holders = tree.entries(f"{rel}/holders") + [h for p in parts for h in tree.entries(f"{rel}/{p}/holders")]
    numbers = {tree.text(f"{rel}/dev", required=False)} | {tree.text(f"{rel}/{p}/dev", required=False) for p in parts}
    return BlockState(
        name=name, numbers=frozenset(n for n in numbers if n), partitions=parts, holders=tuple(_unique(holders)),
        read_only=tree.int(f"{rel}/ro", required=False) == 1, is_partition=tree.exists(f"{rel}/partition"),
    )


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


def read_swaps(path: str | Path = "/proc/swaps") -> str:
    """/proc/swaps text; empty on a kernel built without swap (no such file). Other errors raise OSError."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def _device_mounts(text: str) -> list[Mount]:
    # A mount by a /dev/disk/by-* or /dev/mapper link names the device only once resolved.
    return [Mount(m.target, m.number, os.path.realpath(m.source), m.fstype)
            if m.source and m.source.startswith("/dev/") else m for m in parse_mounts(text)]


def _block_name(rdev: int, sysfs_root: str) -> str | None:
    link = Path(sysfs_root, "dev", "block", f"{os.major(rdev)}:{os.minor(rdev)}")
    return Path(os.readlink(link)).name if link.is_symlink() else None


def _check_access(path: str, st: os.stat_result) -> None:
    """Refuse, saying who may not and why, a device this process cannot open for reading and writing: a node
    without udev's rules leaves block devices root:root 0600, which a training container's user cannot open."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))  # no O_EXCL: opening is harmless, only a probe
    except PermissionError as exc:
        groups = ",".join(str(g) for g in dict.fromkeys([os.getegid(), *os.getgroups()]))
        raise DeviceUnsafeError(path, f"this process (uid {os.geteuid()}, groups {groups}) may not open it for "
                                      f"reading and writing ({exc.strerror}): it is owned by {st.st_uid}:{st.st_gid} "
                                      f"with mode {stat.S_IMODE(st.st_mode):04o}, and the node's block devices "
                                      "should be root:disk 0660 (udev's default rules)") from None
    except OSError:
        pass  # busy, gone, read-only: the checks below say so in their own words


def check_device(path: str, *, sysfs_root: str = "/sys", mountinfo: str = "/proc/self/mountinfo",
                 swaps: str = "/proc/swaps", force: bool = False) -> bool:
    """Raise DeviceUnsafeError naming `path` and every reason when it is not safe to write;
    return whether it is a block device.

    Block devices get every check; regular files (a stratum where no spare
    namespace exists) only the signature check. `force` skips only the
    signature check.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DeviceUnsafeError(path, f"cannot stat: {exc.strerror}") from exc
    is_block = stat.S_ISBLK(st.st_mode)
    if not is_block and not stat.S_ISREG(st.st_mode):
        raise DeviceUnsafeError(path, "neither a block device nor a regular file")
    block, mounts, active = None, [], []
    if is_block:
        name = _block_name(st.st_rdev, sysfs_root) or os.path.basename(os.path.realpath(path))
        tree = SysfsTree(sysfs_root)
        if not tree.exists(f"class/block/{name}"):
            raise DeviceUnsafeError(path, f"no block device {name} in {sysfs_root}/class/block")
        try:
            block = block_state(tree, f"class/block/{name}")
            mounts = _device_mounts(Path(mountinfo).read_text())
            active = parse_swaps(read_swaps(swaps))
        except SysfsError as exc:
            raise DeviceUnsafeError(path, f"cannot tell whether it is in use: {exc}") from exc
        except OSError as exc:
            # Not knowing what is mounted or swapped on is no licence to write.
            raise DeviceUnsafeError(path, f"cannot tell whether it is in use: {exc.filename}: "
                                          f"{exc.strerror}") from exc
    if block is None or not block.read_only:  # writing a read-only device is refused as such below
        _check_access(path, st)
    head: bytes | OSError | None = None
    if not force:
        try:
            head = read_head(path)
        except OSError as exc:
            head = exc
    problems = namespace_problems(head=head, block=block, mounts=mounts, swaps=active, force=force)
    if problems:
        hint = " (force overrides the signature check, nothing else)" if any(
            p.kind == "signature" for p in problems) else ""
        raise DeviceUnsafeError(path, describe(problems) + hint)
    return is_block
