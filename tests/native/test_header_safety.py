"""The memstrata header and the device-safety probes, on real images made by real tools."""
from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from native_helpers import need_tool, run

from memstrata.node.safety import DeviceUnsafeError
from memstrata.node.header import HEADER_BYTES, MAGIC, Header, HeaderError, State, parse_header, render_header
from memstrata.node.safety import PROBE_BYTES, check_device, probe_signature, read_head, sysfs_problems


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


def test_check_device_refuses_a_file_with_a_filesystem_unless_forced(tmp_path: Path) -> None:
    need_tool("mkfs.ext4", "e2fsprogs")
    img = _image(tmp_path, "ext4.img")
    run("mkfs.ext4", "-q", "-F", str(img))
    with pytest.raises(DeviceUnsafeError, match=r"ext4\.img.*carries a ext4 signature") as info:
        check_device(str(img))
    assert info.value.device == str(img)
    check_device(str(img), force=True)  # force overrides only the signature check
    check_device(str(_image(tmp_path, "blank.img")))


def _fake_block(root: Path, name: str, *, holders: tuple[str, ...] = (), parts: tuple[str, ...] = ()) -> None:
    d = root / "class" / "block" / name
    (d / "holders").mkdir(parents=True)
    for h in holders:
        (d / "holders" / h).mkdir()
    for p in parts:
        (d / p).mkdir()
        (d / p / "partition").write_text("1\n")


def test_sysfs_checks_name_holders_partitions_and_mounts(tmp_path: Path) -> None:
    # This kernel has no device-mapper, so a dm holder is given as a sysfs tree;
    # the node-agent issue's QEMU guest asserts it against a real dm target.
    root = tmp_path / "sys"
    _fake_block(root, "nvme0n1", holders=("dm-0",))
    _fake_block(root, "nvme1n1", parts=("nvme1n1p1", "nvme1n1p2"))
    _fake_block(root, "nvme2n1")
    _fake_block(root, "nvme3n1")
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/nvme2n1 /data ext4 rw 0 0\nproc /proc proc rw 0 0\n")
    kw = dict(sysfs_root=str(root), proc_mounts=str(mounts), proc_swaps=str(tmp_path / "none"))
    assert sysfs_problems("nvme0n1", **kw) == ["held by dm-0"]
    assert sysfs_problems("nvme1n1", **kw) == ["has partitions (nvme1n1p1, nvme1n1p2)"]
    assert sysfs_problems("nvme2n1", **kw) == ["mounted at /data (/dev/nvme2n1)"]
    assert sysfs_problems("nvme3n1", **kw) == []
    assert "no such block device" in sysfs_problems("nvme9n1", **kw)[0]
