"""Bytes a block device moved, from /proc/diskstats, and which device backs a directory.

The kernel counts sectors of 512 bytes in /proc/diskstats whatever the device's logical block size
(Documentation/admin-guide/iostats.rst), so bytes = sectors x 512. The counters are the device's, not a
process's: on a shared machine a neighbour's I/O lands in them too, which is why the benchmark records
the counters of every step and takes the median.
"""
from __future__ import annotations

import os
from pathlib import Path

SECTOR = 512
DISKSTATS = Path("/proc/diskstats")


def parse(text: str) -> dict[str, tuple[int, int]]:
    """{device name: (bytes read, bytes written)} from the text of /proc/diskstats (fields 6 and 10 of a line
    are sectors read and sectors written)."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 10:
            continue
        out[f[2]] = (int(f[5]) * SECTOR, int(f[9]) * SECTOR)
    return out


def snapshot(devices: list[str], path: Path = DISKSTATS) -> dict[str, tuple[int, int]]:
    """The counters of `devices` now (a device absent from the file is absent from the answer)."""
    every = parse(path.read_text())
    return {d: every[d] for d in devices if d in every}


def deltas(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """{device: [bytes read, bytes written]} between two snapshots."""
    return {d: [after[d][0] - before[d][0], after[d][1] - before[d][1]] for d in after if d in before}


def device_of(path: Path, sys_block: Path = Path("/sys/dev/block")) -> str:
    """The block device name (as /proc/diskstats spells it) holding the filesystem of `path`, found from the
    file's st_dev through /sys/dev/block/MAJOR:MINOR; a partition is named as itself."""
    st = os.stat(path)
    link = sys_block / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not link.exists():
        raise FileNotFoundError(f"{path} is on device {os.major(st.st_dev)}:{os.minor(st.st_dev)}, which is no "
                                "block device (an overlay or tmpfs?): give --scratch a directory on a disk")
    return link.resolve().name
