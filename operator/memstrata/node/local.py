"""This machine as a NodeInventory, for `memstrata plan` without --node and `memstrata run`.

The NVMe stratum of a local run is a scratch directory on a disk filesystem
(stock DeepSpeed swaps to files), presented as one namespace of its free size.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from memstrata.api.inventory import SCRATCH_CONTROLLER, CxlNode, Gpu, NodeInventory, NumaNode, NvmeNamespace
from memstrata.node.discovery import numa_and_cxl
from memstrata.node.safety import parse_mounts
from memstrata.node.sysfs import SysfsError, SysfsTree

# Filesystems that live in RAM: swapping "to NVMe" there only moves bytes around DRAM.
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "overlay_tmpfs"}


class LocalNodeError(ValueError):
    """This machine cannot be described as a node; the message names what and why."""


class ScratchError(LocalNodeError):
    """The NVMe scratch path cannot be used; the message names the path and why."""


def numa_and_cxl_nodes(sysfs: Path = Path("/sys")) -> tuple[list[NumaNode], list[CxlNode]]:
    """This machine's NUMA and CXL nodes, read by node discovery's own reader (memstrata.node.discovery),
    so a local run sees the CXL expanders the node agent would advertise."""
    try:
        return numa_and_cxl(SysfsTree(sysfs))
    except SysfsError:  # a kernel without NUMA support still has memory: one node with all of it
        kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
        return [NumaNode(id=0, cpus=list(range(os.cpu_count() or 1)), memory_bytes=kb * 1024)], []


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (longest mount-point match in /proc/mounts)."""
    best, fstype = "", "unknown"
    resolved = str(path.resolve())
    for mount in parse_mounts(Path("/proc/mounts").read_text()):
        mnt = mount.target
        if (resolved == mnt or resolved.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, mount.fstype
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
        # A name of its own: the ranks of one job probe the same directory at the same moment, and a shared
        # name let one rank's unlink fail another's probe ("not writable: No such file or directory").
        fd, probe = tempfile.mkstemp(dir=path, prefix=".memstrata-write-probe-")
        os.write(fd, b"x")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise ScratchError(f"{path}: NVMe scratch path is not writable: {exc.strerror or exc}") from None
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


SMI_QUERY = ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
GpuLister = Callable[[], list[Gpu]]


def parse_nvidia_smi(text: str, visible: str | None) -> list[Gpu]:
    """GPUs from SMI_QUERY's CSV (memory in MiB), as CUDA numbers them under CUDA_VISIBLE_DEVICES
    (indices or GPU UUIDs, in the listed order; set but empty hides every device). Pure; raises
    LocalNodeError naming what it cannot read."""
    rows = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit():
            raise LocalNodeError(f"nvidia-smi: cannot read the GPU line {line.strip()!r}")
        index, uuid, name, mib = fields
        if not mib.isdigit():  # "[N/A]" on some virtualised or MIG-enabled GPUs
            raise LocalNodeError(f"nvidia-smi reports no memory size for GPU {index} ({name}): {mib!r}; "
                                 "describe the node with `--node FILE` instead")
        rows.append((int(index), uuid, name, int(mib) << 20))
    if visible is not None:
        chosen = []
        for want in (v.strip() for v in visible.split(",") if v.strip()):
            match = [r for r in rows if (str(r[0]) == want if want.isdigit() else r[1].startswith(want))]
            if not match:
                # CUDA stops at the first entry it cannot resolve (MIG instances included): so do we.
                break
            chosen.append(match[0])
        rows = chosen
    return [Gpu(index=i, name=name, hbm_bytes=hbm) for i, (_, _, name, hbm) in enumerate(rows)]


def nvidia_smi_gpus() -> list[Gpu]:
    """This machine's GPUs through nvidia-smi; none without an NVIDIA driver."""
    if not Path("/proc/driver/nvidia/gpus").exists():
        return []
    try:
        out = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise LocalNodeError(f"this machine has an NVIDIA driver but nvidia-smi cannot list its GPUs ({exc}); "
                             "describe the node with `--node FILE` instead") from None
    return parse_nvidia_smi(out, os.environ.get("CUDA_VISIBLE_DEVICES"))


def local_inventory(nvme_path: Path | None, gpus: GpuLister = nvidia_smi_gpus) -> NodeInventory:
    """This machine. `gpus` lists its GPUs: nvidia-smi here on the operator floor (no torch); a local
    training run, which has torch anyway, passes the runtime's lister instead, which needs no nvidia-smi."""
    namespaces = []
    if nvme_path is not None:
        free = check_scratch(nvme_path)
        namespaces.append(NvmeNamespace(name=str(nvme_path), controller=SCRATCH_CONTROLLER, size_bytes=free,
                                        logical_block_size=4096, free=True))
    numa, cxl = numa_and_cxl_nodes()
    return NodeInventory(hostname=os.uname().nodename, numa_nodes=numa, cxl_nodes=cxl, nvme_namespaces=namespaces,
                         gpus=gpus())
