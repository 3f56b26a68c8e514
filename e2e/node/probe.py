"""Run inside the test guest: record the node's topology as a user-space program sees it.

Writes $MEMSTRATA_OUT/facts.json (read by test_guest.py on the host) and a
sysfs capture (capture_sysfs.py) as $MEMSTRATA_OUT/capture.tar. Standard
library only, plus libnuma through ctypes to prove the CXL node's memory is
really allocatable — the thing a user of the node relies on.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import time
import sys
from pathlib import Path

SYS = Path("/sys")
OUT = Path(os.environ.get("MEMSTRATA_OUT", "/out"))


def read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as e:
        return f"<error {e.errno}>"


def meminfo_kb(node: Path) -> int:
    for line in read(node / "meminfo").splitlines():
        if "MemTotal:" in line:
            return int(line.split()[-2])
    return 0


def numa_nodes() -> dict[str, dict]:
    nodes = {}
    for node in sorted((SYS / "devices/system/node").glob("node[0-9]*")):
        nodes[node.name[4:]] = {"cpulist": read(node / "cpulist"), "mem_total_kb": meminfo_kb(node)}
    return nodes


def memory_tiers() -> dict[str, str]:
    base = SYS / "devices/virtual/memory_tiering"
    return {t.name: read(t / "nodelist") for t in sorted(base.glob("memory_tier*"))}


def cxl() -> dict:
    devices = SYS / "bus/cxl/devices"
    regions = {}
    for r in sorted(devices.glob("region*")):
        regions[r.name] = {k: read(r / k) for k in ("size", "commit", "mode", "target0", "interleave_ways")}
        regions[r.name]["driver"] = os.path.basename(os.path.realpath(r / "driver")) if (r / "driver").exists() else ""
    dax = {d.name: {"target_node": read(d / "target_node"),
                    "driver": os.path.basename(os.path.realpath(d / "driver"))}
           for d in sorted((SYS / "bus/dax/devices").glob("dax*"))}
    mems = {m.name: {"ram_size": read(m / "ram/size"), "serial": read(m / "serial"),
                     "numa_node": read(m / "numa_node")}
            for m in sorted(devices.glob("mem[0-9]*"))}
    return {"devices": sorted(p.name for p in devices.iterdir()), "regions": regions, "dax": dax, "mems": mems}


def nvme() -> dict:
    ctrls = {c.name: {k: read(c / k) for k in ("model", "serial", "firmware_rev")}
             for c in sorted((SYS / "class/nvme").iterdir())}
    blocks = {}
    for b in sorted((SYS / "block").glob("nvme*")):
        blocks[b.name] = {
            "hidden": read(b / "hidden"), "nsid": read(b / "nsid"), "size_sectors": read(b / "size"),
            "partitions": sorted(p.name for p in b.iterdir() if p.name.startswith(b.name + "p")),
            "holders": sorted(p.name for p in (b / "holders").iterdir()),
        }
    # Hidden per-path nodes live under the controller, not always in /sys/block.
    paths = sorted(p.name for c in (SYS / "class/nvme").iterdir() for p in c.iterdir()
                   if p.name.startswith("nvme") and "c" in p.name[4:] and "n" in p.name[4:])
    return {"controllers": ctrls, "blocks": blocks, "path_nodes": paths}


def signatures(blocks: dict) -> dict[str, dict]:
    sigs = {}
    for name, info in blocks.items():
        if info["hidden"] == "1":
            continue
        with open(f"/dev/{name}", "rb") as f:
            head = f.read(8192)
        blkid = subprocess.run(["blkid", "-p", "-o", "export", f"/dev/{name}"],
                               capture_output=True, text=True)
        sigs[name] = {
            "all_zero_head": not any(head),
            "ext4_magic": head[1024 + 56:1024 + 58] == b"\x53\xef",
            "gpt_header": head[512:520] == b"EFI PART",
            "blkid": blkid.stdout.strip(),
        }
    return sigs


def node_of_allocation(node: int, size: int = 64 << 10) -> int:
    """Allocate `size` bytes bound to `node` with libnuma, touch them, and ask the kernel where they are.

    Small on purpose: QEMU emulates CXL memory accesses through its I/O path
    (interleave decoding in software), so touching megabytes of it takes minutes.
    """
    numa = ctypes.CDLL("libnuma.so.1", use_errno=True)
    numa.numa_alloc_onnode.restype = ctypes.c_void_p
    numa.numa_alloc_onnode.argtypes = [ctypes.c_size_t, ctypes.c_int]
    numa.numa_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    numa.numa_move_pages.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    addr = numa.numa_alloc_onnode(size, node)
    if not addr:
        return -1
    try:
        ctypes.memset(addr, 0xA5, size)
        last = addr + size - 4096
        pages = (ctypes.c_void_p * 2)(addr, last)
        status = (ctypes.c_int * 2)(-1, -1)
        if numa.numa_move_pages(0, 2, pages, None, status, 0) != 0:
            return -ctypes.get_errno()
        return status[0] if status[0] == status[1] else -1000 - status[1]
    finally:
        numa.numa_free(addr, size)


def main() -> int:
    print(f"probe: topology {time.monotonic():.2f}", file=sys.stderr)
    facts = {"numa": numa_nodes(), "has_cpu": read(SYS / "devices/system/node/has_cpu"),
             "tiers": memory_tiers(), "cxl": cxl(), "nvme": nvme(),
             "mounts": Path("/proc/mounts").read_text(), "uname": os.uname().release,
             "python": sys.version.split()[0], "sys_path": sys.path}
    facts["signatures"] = signatures(facts["nvme"]["blocks"])
    print(f"probe: allocations {time.monotonic():.2f}", file=sys.stderr)
    facts["alloc_node"] = {n: node_of_allocation(int(n)) for n, info in facts["numa"].items()
                           if not info["cpulist"]}
    (OUT / "facts.json").write_text(json.dumps(facts, indent=1, sort_keys=True))
    print(f"probe: capture {time.monotonic():.2f}", file=sys.stderr)
    sys.path.insert(0, "/repo/e2e/node")
    import capture_sysfs
    print(capture_sysfs.capture_tar(OUT / "capture.tar", "capture"))
    print(f"probe: done {time.monotonic():.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
