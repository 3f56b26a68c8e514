"""The memstrata header and the device-safety probes, on real images made by real tools."""
from __future__ import annotations

import pickle
import subprocess
import uuid
from pathlib import Path

import pytest
from native_helpers import need_tool, run

from memstrata.node.header import HEADER_BYTES, MAGIC, Header, HeaderError, State, parse_header, render_header
from memstrata.node.safety import (
    PROBE_BYTES, BlockState, DeviceUnsafeError, block_state, check_device, describe, namespace_problems,
    parse_mounts, parse_swaps, probe_signature, read_head,
)
from memstrata.node.sysfs import SysfsTree


def _header(**kw: object) -> Header:
    base = dict(owner_job="ns/job-1", generation=7, state=State.OPEN, set_id=uuid.uuid4(), set_index=1,
                set_size=2, logical_block_size=512, capacity_bytes=1 << 30, owner_pid=42, updated_ns=5)
    base.update(kw)
    return Header(**base)  # type: ignore[arg-type]


def test_header_round_trip_and_damage_is_reported() -> None:
    h = _header()
    raw = render_header(h)
    assert len(raw) == HEADER_BYTES and raw.startswith(MAGIC)
    assert parse_header(raw) == h
    assert parse_header(bytes(HEADER_BYTES)) is None
    damaged = bytearray(raw)
    damaged[40] ^= 0xFF
    with pytest.raises(HeaderError, match="checksum"):
        parse_header(bytes(damaged))
    with pytest.raises(HeaderError, match="owner_job"):
        render_header(_header(owner_job="x" * 300))


def test_probe_ignores_blank_space_and_memstrata_header() -> None:
    assert probe_signature(bytes(PROBE_BYTES)) is None
    assert probe_signature(render_header(_header()) + bytes(PROBE_BYTES)) is None


def test_a_leftover_memstrata_header_hides_no_signature_behind_it() -> None:
    head = bytearray(render_header(_header()) + bytes(PROBE_BYTES))
    head[65536 + 64 : 65536 + 72] = b"_BHRfS_M"
    assert probe_signature(bytes(head)) == "btrfs"


def _image(tmp_path: Path, name: str, size: int = 64 << 20) -> Path:
    img = tmp_path / name
    with open(img, "wb") as f:
        f.truncate(size)
    return img


@pytest.mark.parametrize("tool,package,args,expected", [
    ("mkfs.ext4", "e2fsprogs", ["-q", "-F"], "ext4"),
    ("mkfs.ext2", "e2fsprogs", ["-q", "-F"], "ext2"),
    ("mkswap", "util-linux", [], "swap"),
    ("sgdisk", "gdisk", ["-o"], "gpt"),
    ("mkfs.xfs", "xfsprogs", ["-q"], "xfs"),
    ("mkfs.btrfs", "btrfs-progs", ["-q"], "btrfs"),
])
def test_probe_names_what_real_tools_wrote(tmp_path: Path, tool: str, package: str, args: list[str],
                                           expected: str) -> None:
    need_tool(tool, package)
    img = _image(tmp_path, "fs.img", 512 << 20)  # sparse; mkfs.xfs wants > 300 MB
    run(tool, *args, str(img))
    kind = probe_signature(read_head(str(img)))
    assert kind is not None and kind.startswith(expected), kind


def test_probe_names_an_mbr_written_by_sfdisk(tmp_path: Path) -> None:
    need_tool("sfdisk", "fdisk")
    img = _image(tmp_path, "mbr.img")
    subprocess.run(["sfdisk", "-q", str(img)], input="label: dos\n,16M\n", text=True, check=True,
                   capture_output=True)
    assert probe_signature(read_head(str(img))) == "dos (MBR partition table)"


def test_a_partition_table_written_over_a_memstrata_header_is_refused(tmp_path: Path) -> None:
    # sgdisk keeps the MBR's boot-code bytes, where memstrata's magic sits: the magic still
    # leads the device, and only probing behind it finds the partition table.
    need_tool("sgdisk", "gdisk")
    img = _image(tmp_path, "reused.img")
    with open(img, "r+b") as f:
        f.write(render_header(_header()))
    run("sgdisk", "-o", str(img))
    assert read_head(str(img)).startswith(MAGIC)
    with pytest.raises(DeviceUnsafeError, match=r"reused\.img: refusing to use it: foreign signature: gpt"):
        check_device(str(img))


def test_check_device_refuses_a_file_with_a_filesystem_unless_forced(tmp_path: Path) -> None:
    need_tool("mkfs.ext4", "e2fsprogs")
    img = _image(tmp_path, "ext4.img")
    run("mkfs.ext4", "-q", "-F", str(img))
    with pytest.raises(DeviceUnsafeError, match=r"ext4\.img: refusing to use it: foreign signature: ext4 "
                                                r"\(force overrides the signature check, nothing else\)") as info:
        check_device(str(img))
    assert info.value.device == str(img)
    # A refusal raised in a worker process reaches its parent whole (pickled), device and reason intact.
    again = pickle.loads(pickle.dumps(info.value))
    assert (type(again), again.device, str(again)) == (DeviceUnsafeError, str(img), str(info.value))
    check_device(str(img), force=True)  # force overrides only the signature check
    check_device(str(_image(tmp_path, "blank.img")))


def _fake_block(root: Path, name: str, *, dev: str, holders: tuple[str, ...] = (), parts: tuple[str, ...] = (),
                ro: bool = False) -> None:
    d = root / "class" / "block" / name
    (d / "holders").mkdir(parents=True)
    (d / "dev").write_text(dev + "\n")
    (d / "ro").write_text("1\n" if ro else "0\n")
    for h in holders:
        (d / "holders" / h).mkdir()
    for i, p in enumerate(parts, 1):
        (d / p / "holders").mkdir(parents=True)
        (d / p / "partition").write_text(f"{i}\n")
        (d / p / "dev").write_text(f"{dev.split(':')[0]}:{int(dev.split(':')[1]) + i}\n")


MOUNTINFO = """\
22 1 259:3 / /data rw,relatime shared:1 - ext4 /dev/nvme2n1 rw
23 1 0:41 / /srv rw,relatime shared:2 - btrfs /dev/nvme5n1 rw
24 1 259:12 / /home rw,relatime shared:3 - xfs /dev/disk/by-label/home rw
25 1 0:5 / /proc rw - proc proc rw
"""
SWAPS = "Filename Type Size Used Priority\n/dev/nvme4n1 partition 1048572 0 -2\n"


@pytest.mark.parametrize("name, facts, expected", [
    ("nvme0n1", dict(dev="259:0", holders=("dm-0",)), ["held by dm-0"]),
    ("nvme1n1", dict(dev="259:100", parts=("nvme1n1p1", "nvme1n1p2")), ["has partitions (nvme1n1p1, nvme1n1p2)"]),
    ("nvme2n1", dict(dev="259:3"), ["mounted at /data"]),  # by device number and by name
    ("nvme3n1", dict(dev="259:11", parts=("nvme3n1p1",)),  # a partition mounted through a by-label link
     ["has partitions (nvme3n1p1)", "mounted at /home"]),
    ("nvme4n1", dict(dev="259:20"), ["active swap (/dev/nvme4n1)"]),
    ("nvme5n1", dict(dev="259:30"), ["mounted at /srv"]),  # btrfs: only the source names the device
    ("nvme6n1", dict(dev="259:40", ro=True), ["read-only"]),
    ("nvme7n1", dict(dev="259:50"), []),
])
def test_every_in_use_check_from_a_sysfs_tree(tmp_path: Path, name: str, facts: dict, expected: list[str]) -> None:
    # This kernel has no device-mapper, so a dm holder is given as a sysfs tree;
    # the node-agent issue's QEMU guest asserts it against a real dm target.
    _fake_block(tmp_path, name, **facts)
    block = block_state(SysfsTree(tmp_path), f"class/block/{name}")
    problems = namespace_problems(head=bytes(PROBE_BYTES), block=block, mounts=parse_mounts(MOUNTINFO),
                                  swaps=parse_swaps(SWAPS))
    assert [p.reason for p in problems] == expected


def test_signature_is_checked_first_and_force_overrides_it_alone() -> None:
    busy = BlockState("nvme0n1", frozenset({"259:0"}), partitions=("nvme0n1p1",), read_only=True)
    swaps = ["/dev/nvme0n1p1"]
    ext4 = bytearray(PROBE_BYTES)
    ext4[1024 + 56 : 1024 + 58] = b"\x53\xef"
    everything = namespace_problems(head=bytes(ext4), block=busy, mounts=[], swaps=swaps)
    assert describe(everything) == ("foreign signature: ext2; has partitions (nvme0n1p1); "
                                    "active swap (/dev/nvme0n1p1); read-only")
    forced = namespace_problems(head=None, block=busy, mounts=[], swaps=swaps, force=True)
    assert [p.kind for p in forced] == ["partition", "swap", "read-only"]
    unread = namespace_problems(head=OSError(5, "Input/output error"), block=None, mounts=[], swaps=[])
    assert describe(unread) == "first blocks unreadable (Input/output error)"


def test_neither_block_device_nor_file_is_refused() -> None:
    with pytest.raises(DeviceUnsafeError, match="/dev/null: refusing to use it: neither a block device nor a regular"):
        check_device("/dev/null")


@pytest.mark.loopdev
def test_a_block_device_sysfs_does_not_know_is_refused(loopdev, tmp_path: Path) -> None:
    dev = loopdev(4 << 20)
    with pytest.raises(DeviceUnsafeError, match=rf"{dev}: refusing to use it: no block device loop\d+ in {tmp_path}"):
        check_device(dev, sysfs_root=str(tmp_path), force=True)
