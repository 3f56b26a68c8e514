"""This machine as a NodeInventory, for `memstrata plan` without --node and `memstrata run`.

The NVMe stratum of a local run is a scratch directory on a disk filesystem
(stock DeepSpeed swaps to files), presented as one namespace of its free size.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from memstrata.api.inventory import Gpu, NodeInventory, NumaNode, NvmeNamespace

# Filesystems that live in RAM: swapping "to NVMe" there only moves bytes around DRAM.
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "overlay_tmpfs"}


class ScratchError(ValueError):
    """The NVMe scratch path cannot be used; the message names the path and why."""


def _cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def numa_nodes(sysfs: Path = Path("/sys")) -> list[NumaNode]:
    root = sysfs / "devices/system/node"
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = (d / "meminfo").read_text()
        kb = next(int(line.split()[-2]) for line in meminfo.splitlines() if "MemTotal" in line)
        cpus = _cpulist((d / "cpulist").read_text())
        nodes.append(NumaNode(id=int(d.name[4:]), kind="dram" if cpus else "memory-only", cpus=cpus,
                              memory_bytes=kb * 1024, distances=[int(x) for x in (d / "distance").read_text().split()]))
    if not nodes:  # kernels without NUMA support still have memory
        kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
        nodes.append(NumaNode(id=0, cpus=list(range(os.cpu_count() or 1)), memory_bytes=kb * 1024))
    return nodes


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (longest mount-point match in /proc/mounts)."""
    best, fstype = "", "unknown"
    resolved = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        mnt = fields[1].replace("\\040", " ")
        if (resolved == mnt or resolved.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, fields[2]
    return fstype


def check_scratch(path: Path) -> int:
    """Prove `path` usable as the NVMe stratum of a local run; return its free bytes.

    The filesystem is checked on the nearest existing ancestor before anything is
    created, so a refused path leaves nothing behind.
    """
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fstype = filesystem_type(existing)
    if fstype in MEMORY_FILESYSTEMS:
        raise ScratchError(f"{path}: NVMe scratch path is on {fstype}, which lives in RAM; use a disk filesystem")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".memstrata-write-probe"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise ScratchError(f"{path}: NVMe scratch path is not writable: {exc.strerror or exc}") from None
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _gpus() -> list[Gpu]:
    if not Path("/proc/driver/nvidia/gpus").exists():
        return []  # importing torch costs seconds; only do it where a GPU can be
    import torch

    return [Gpu(index=i, name=torch.cuda.get_device_name(i), hbm_bytes=torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def local_inventory(nvme_path: Path | None) -> NodeInventory:
    namespaces = []
    if nvme_path is not None:
        free = check_scratch(nvme_path)
        namespaces.append(NvmeNamespace(name=str(nvme_path), controller="scratch-directory", size_bytes=free,
                                        logical_block_size=4096, free=True))
    return NodeInventory(hostname=os.uname().nodename, numa_nodes=numa_nodes(), nvme_namespaces=namespaces,
                         gpus=_gpus())
