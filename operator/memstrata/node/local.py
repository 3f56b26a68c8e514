"""This machine as a NodeInventory, for `memstrata plan` without --node and `memstrata run`.

The NVMe stratum of a local run is a scratch directory on a disk filesystem
(stock DeepSpeed swaps to files), presented as one namespace of its free size.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from memstrata.api.inventory import Gpu, NodeInventory, NumaNode, NvmeNamespace
from memstrata.node.safety import parse_mounts
from memstrata.node.sysfs import parse_list

# Filesystems that live in RAM: swapping "to NVMe" there only moves bytes around DRAM.
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "overlay_tmpfs"}


class LocalNodeError(ValueError):
    """This machine cannot be described as a node; the message names what and why."""


class ScratchError(LocalNodeError):
    """The NVMe scratch path cannot be used; the message names the path and why."""


def numa_nodes(sysfs: Path = Path("/sys")) -> list[NumaNode]:
    root = sysfs / "devices/system/node"
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = (d / "meminfo").read_text()
        kb = next(int(line.split()[-2]) for line in meminfo.splitlines() if "MemTotal" in line)
        cpus = parse_list((d / "cpulist").read_text())
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


def parse_nvidia_smi(text: str, visible: str | None) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`
    (MiB), restricted to CUDA_VISIBLE_DEVICES' indices the way CUDA numbers them. Pure."""
    rows = []
    for line in text.strip().splitlines():
        index, name, mib = (f.strip() for f in line.split(","))
        rows.append((int(index), name, int(float(mib)) << 20))
    if visible is not None:
        # Set but empty hides every device from CUDA; UUIDs/MIG names are kept as listed by the driver.
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        if not wanted:
            return []
        if all(w.isdigit() for w in wanted):
            by_index = {r[0]: r for r in rows}
            rows = [by_index[int(w)] for w in wanted if int(w) in by_index]
    return [Gpu(index=i, name=name, hbm_bytes=hbm) for i, (_, name, hbm) in enumerate(rows)]


def _gpus() -> list[Gpu]:
    # nvidia-smi, not torch: the operator floor (the CLI's `plan`) must not need torch.
    if not Path("/proc/driver/nvidia/gpus").exists():
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise LocalNodeError(f"this machine has an NVIDIA driver but nvidia-smi cannot list its GPUs: {exc}") from None
    return parse_nvidia_smi(out, os.environ.get("CUDA_VISIBLE_DEVICES"))


def local_inventory(nvme_path: Path | None) -> NodeInventory:
    namespaces = []
    if nvme_path is not None:
        free = check_scratch(nvme_path)
        namespaces.append(NvmeNamespace(name=str(nvme_path), controller="scratch-directory", size_bytes=free,
                                        logical_block_size=4096, free=True))
    return NodeInventory(hostname=os.uname().nodename, numa_nodes=numa_nodes(), nvme_namespaces=namespaces,
                         gpus=_gpus())
