"""Writes the hand-made sysfs corner cases under tests/data/sysfs/<case>/.

    python3 tests/nodeagent/sysfs_cases.py      # regenerate every case

Each case has the layout of a capture made by e2e/node/capture_sysfs.py
(`sys/...`, `proc/mounts`, `proc/swaps`, `dev/<namespace>.head`), and follows the kernel
6.12 layout seen in the QEMU guest: NUMA nodes, memory tiers, CXL regions
with kmem-onlined dax devices, NVMe controllers with and without native
multipath. The cases cover what the QEMU guest cannot: two sockets, several
CXL nodes with interleaved memdevs, an HMEM node, 4 KiB namespaces,
read-only, mounted, active-swap and memstrata-owned namespaces, a GPT
written over a memstrata header, and malformed trees.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from memstrata.api.inventory import NodeInventory
from memstrata.node.header import Header, State, render_header

DATA = Path(__file__).resolve().parents[1] / "data" / "sysfs"
GiB = 1 << 30


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.mounts: list[str] = []
        self.swaps: list[str] = []

    def write(self, rel: str, text: str) -> None:
        path = self.sys / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n")

    def link(self, rel: str, target: str) -> None:
        """A relative symlink at sys/<rel> to sys/<target>, like /sys has."""
        path = self.sys / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(os.path.relpath(self.sys / target, path.parent))

    def head(self, name: str, data: bytes) -> None:
        (self.root / "dev").mkdir(parents=True, exist_ok=True)
        (self.root / "dev" / f"{name}.head").write_bytes(data.ljust(4096, b"\0"))

    def numa(self, nid: int, cpus: str, mem_bytes: int, distance: str) -> None:
        base = f"devices/system/node/node{nid}"
        self.write(f"{base}/cpulist", cpus)
        self.write(f"{base}/meminfo", f"Node {nid} MemTotal:       {mem_bytes // 1024} kB\n"
                                      f"Node {nid} MemFree:        {mem_bytes // 2048} kB\n")
        self.write(f"{base}/distance", distance)

    def tier(self, tier: int, nodelist: str) -> None:
        self.write(f"devices/virtual/memory_tiering/memory_tier{tier}/nodelist", nodelist)

    def cxl_region(self, region: int, node: int, size: int, mems: list[tuple[int, str, int]]) -> None:
        """A ram region over `mems` [(memdev index, serial, ram bytes)], onlined by kmem as `node`."""
        root = "devices/platform/ACPI0017:00/root0"
        rdir = f"{root}/decoder0.{region}/region{region}"
        self.write(f"{rdir}/size", hex(size))
        self.write(f"{rdir}/mode", "ram")
        self.write(f"{rdir}/commit", "1")
        self.write(f"{rdir}/interleave_ways", str(len(mems)))
        self.link(f"bus/cxl/devices/region{region}", rdir)
        for i, (m, serial, ram) in enumerate(mems):
            port = f"{root}/port{m + 1}/endpoint{m + 10}"
            mdir = f"devices/pci0000:0c/0000:0c:00.0/0000:0d:0{m}.0/mem{m}"
            if not (self.sys / mdir).exists():
                self.write(f"{mdir}/serial", serial)
                self.write(f"{mdir}/ram/size", hex(ram))
                self.write(f"{mdir}/numa_node", "-1")
                self.link(f"bus/cxl/devices/mem{m}", mdir)
                self.link(f"{port}/uport", mdir)
            decoder = f"decoder{m + 10}.0"
            self.write(f"{port}/{decoder}/mode", "ram")
            self.link(f"bus/cxl/devices/{decoder}", f"{port}/{decoder}")
            self.write(f"{rdir}/target{i}", decoder)
        dax = f"{rdir}/dax_region{region}/dax{region}.0"
        self.write(f"{dax}/target_node", str(node))
        self.write(f"{dax}/size", str(size))
        self.link(f"{dax}/driver", "bus/dax/drivers/kmem")
        self.link(f"bus/dax/devices/dax{region}.0", dax)

    def hmem(self, idx: int, node: int) -> None:
        dax = f"devices/platform/hmem.{idx}/dax{idx}.0"
        self.write(f"{dax}/target_node", str(node))
        self.link(f"{dax}/driver", "bus/dax/drivers/kmem")
        self.link(f"bus/dax/devices/dax{idx}.0", dax)

    def controller(self, c: int, pci: str, numa: int, multipath: bool) -> str:
        cdir = f"devices/pci0000:00/{pci}/nvme/nvme{c}"
        self.write(f"devices/pci0000:00/{pci}/numa_node", str(numa))
        self.write(f"{cdir}/model", f"Example NVMe {c}")
        self.write(f"{cdir}/serial", f"SN{c:04d}")
        self.write(f"{cdir}/firmware_rev", "1.0")
        self.write(f"{cdir}/transport", "pcie")
        self.write(f"{cdir}/numa_node", str(numa))
        self.link(f"{cdir}/device", f"devices/pci0000:00/{pci}")
        self.link(f"class/nvme/nvme{c}", cdir)
        self._multipath = multipath
        return cdir

    def namespace(self, cdir: str, c: int, nsid: int, size: int, lbs: int = 512, *, ro: bool = False,
                  head: bytes = b"", partitions: int = 0, holders: tuple[str, ...] = ()) -> str:
        name = f"nvme{c}n{nsid}"
        if self._multipath:
            ndir = f"devices/virtual/nvme-subsystem/nvme-subsys{c}/{name}"
            path = f"{cdir}/nvme{c}c{c}n{nsid}"
            self.write(f"{path}/hidden", "1")
            self.write(f"{path}/nsid", str(nsid))
            self.link(f"block/nvme{c}c{c}n{nsid}", path)
            self.link(f"{ndir}/multipath/nvme{c}c{c}n{nsid}", path)
        else:
            ndir = f"{cdir}/{name}"
        self.write(f"{ndir}/nsid", str(nsid))
        self.write(f"{ndir}/size", str(size // 512))
        self.write(f"{ndir}/queue/logical_block_size", str(lbs))
        self.write(f"{ndir}/wwid", f"eui.00000000000000{c:02d}{nsid:02d}")
        self.write(f"{ndir}/ro", "1" if ro else "0")
        self.write(f"{ndir}/hidden", "0")
        self.write(f"{ndir}/dev", f"259:{c * 16 + nsid}")
        return self.block(ndir, name, head=head, partitions=partitions, holders=holders,
                          partition_minor=100 + c * 16 + nsid * 4)

    def loop(self, n: int, size: int, *, lbs: int = 512, backing: str | None, ro: bool = False,
             head: bytes = b"", partitions: int = 0, holders: tuple[str, ...] = ()) -> str:
        """loop<n>, attached to the file `backing` (None: detached, as after a reboot: size 0, no loop/)."""
        name, ldir = f"loop{n}", f"devices/virtual/block/loop{n}"
        self.write(f"{ldir}/size", str(size // 512 if backing else 0))
        self.write(f"{ldir}/queue/logical_block_size", str(lbs))
        self.write(f"{ldir}/ro", "1" if ro else "0")
        self.write(f"{ldir}/dev", f"7:{n}")
        if backing:
            self.write(f"{ldir}/loop/backing_file", backing)
        return self.block(ldir, name, head=head, partitions=partitions, holders=holders, partition_minor=n * 4)

    def block(self, ndir: str, name: str, *, head: bytes, partitions: int, holders: tuple[str, ...],
              partition_minor: int) -> str:
        """What every block device has: holders/, partitions, its block/ link and its first bytes."""
        (self.sys / ndir / "holders").mkdir(parents=True, exist_ok=True)
        for h in holders:
            self.link(f"{ndir}/holders/{h}", f"devices/virtual/block/{h}")
            self.write(f"devices/virtual/block/{h}/dm/name", "vg-lv")
        for p in range(1, partitions + 1):
            self.write(f"{ndir}/{name}p{p}/partition", str(p))
            self.write(f"{ndir}/{name}p{p}/dev", f"259:{partition_minor + p}")
        self.link(f"block/{name}", ndir)
        self.head(name, head)
        return name

    def finish(self) -> None:
        (self.root / "proc").mkdir(parents=True, exist_ok=True)
        base = ["sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0", "/dev/vda / ext4 rw,relatime 0 0"]
        (self.root / "proc" / "mounts").write_text("\n".join(base + self.mounts) + "\n")
        header = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority"
        (self.root / "proc" / "swaps").write_text("\n".join([header] + self.swaps) + "\n")


def ext4_head() -> bytes:
    head = bytearray(4096)
    head[1024 + 56:1024 + 58] = b"\x53\xef"
    head[1024 + 96:1024 + 100] = (0x40).to_bytes(4, "little")  # INCOMPAT_EXTENTS
    return bytes(head)


def swap_head() -> bytes:
    """What mkswap leaves in the first 4 KiB: its magic at the end of the first page."""
    head = bytearray(4096)
    head[4096 - 10:] = b"SWAPSPACE2"
    return bytes(head)


def gpt_over_memstrata_head() -> bytes:
    """`sgdisk -o` over a namespace memstrata used: the GPT lands at LBA 1 and the boot-code
    bytes (where memstrata's magic is) are kept, so the magic still leads the device."""
    head = bytearray(memstrata_head())
    head[446:462] = bytes.fromhex("00000200ee28200801000000ffff0100")  # protective entry, type 0xEE from LBA 1
    head[510:512] = b"\x55\xaa"
    head[512:520] = b"EFI PART"
    return bytes(head)


def memstrata_head(state: State = State.SCRUBBED) -> bytes:
    """A namespace memstrata used: SCRUBBED (free to offer) unless told otherwise."""
    return render_header(Header(owner_job="default/llama", generation=3, state=state,
                                set_id=uuid.UUID(int=7), set_index=0, set_size=1, logical_block_size=4096,
                                capacity_bytes=8 * GiB))


def inventory_of(root: Path, mounts: str | None = None, hostname: str = "n1") -> NodeInventory:
    """What discovery makes of a case (or a capture) at `root`: its sysfs, its first blocks, its mount table (or
    `mounts`) and its active swaps (older captures have none: no swap was active there)."""
    from memstrata.node.discovery import dev_heads, discover

    text = mounts if mounts is not None else (root / "proc" / "mounts").read_text()
    swaps = root / "proc" / "swaps"
    return discover(root / "sys", heads=dev_heads(root / "dev"), mounts_text=text,
                    swaps_text=swaps.read_text() if swaps.exists() else "", hostname=hostname)

def two_socket_cxl(root: Path) -> None:
    """2 sockets, 2 CXL nodes (one 2-way interleaved), an HMEM node, 2 NVMe controllers."""
    t = Tree(root)
    t.numa(0, "0-3,8-11", 64 * GiB, "10 21 14 24 17")
    t.numa(1, "4-7,12-15", 64 * GiB, "21 10 24 14 27")
    t.numa(2, "", 32 * GiB, "14 24 10 26 20")
    t.numa(3, "", 16 * GiB + (512 << 20), "24 14 26 10 30")
    t.numa(4, "", 8 * GiB, "17 27 20 30 10")
    t.numa(5, "", 0, "")  # a possible but empty node: ignored
    t.tier(4, "0-1,4")
    t.tier(22, "2-3")
    t.cxl_region(0, node=2, size=32 * GiB, mems=[(0, "0x1111", 16 * GiB), (1, "0x2222", 16 * GiB)])
    t.cxl_region(1, node=3, size=16 * GiB + (512 << 20), mems=[(2, "0x3333", 16 * GiB + (512 << 20))])
    t.hmem(5, node=4)
    c0 = t.controller(0, "0000:00:04.0", numa=0, multipath=False)
    t.namespace(c0, 0, 1, 100 * GiB, 4096)
    t.namespace(c0, 0, 2, 50 * GiB, 4096)
    t.mounts.append("/dev/nvme0n2 /scratch xfs rw,relatime 0 0")
    c1 = t.controller(1, "0000:80:01.0", numa=1, multipath=True)
    t.namespace(c1, 1, 1, 200 * GiB)
    t.namespace(c1, 1, 2, 10 * GiB, head=memstrata_head())
    t.namespace(c1, 1, 3, 10 * GiB, head=ext4_head())
    t.namespace(c1, 1, 4, 10 * GiB, ro=True)
    t.namespace(c1, 1, 5, 10 * GiB, partitions=2)
    t.mounts.append("/dev/nvme1n5p2 /data ext4 rw 0 0")
    t.namespace(c1, 1, 6, 10 * GiB, holders=("dm-0",))
    t.namespace(c1, 1, 7, 10 * GiB, head=swap_head())
    t.swaps.append("/dev/nvme1n7                            partition\t10485756\t0\t\t-2")
    t.namespace(c1, 1, 8, 10 * GiB, head=gpt_over_memstrata_head())
    t.finish()


def dram_only(root: Path) -> None:
    """One node, no CXL, no NVMe driver loaded (no /sys/class/nvme at all)."""
    t = Tree(root)
    t.numa(0, "0-1", 24 * GiB, "10")
    t.tier(4, "0")
    (t.sys / "block").mkdir(parents=True)
    t.finish()


def _minimal(root: Path) -> Tree:
    t = Tree(root)
    t.numa(0, "0-1", 8 * GiB, "10")
    c = t.controller(0, "0000:00:04.0", numa=0, multipath=False)
    t.namespace(c, 0, 1, 10 * GiB)
    return t


def bad_meminfo(root: Path) -> None:
    t = _minimal(root)
    t.write("devices/system/node/node0/meminfo", "Node 0 MemFree: 12 kB")
    t.finish()


def bad_cpulist(root: Path) -> None:
    t = _minimal(root)
    t.write("devices/system/node/node0/cpulist", "0-x")
    t.finish()


def bad_nsid(root: Path) -> None:
    t = _minimal(root)
    t.write("devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1/nsid", "one")
    t.finish()


def missing_size(root: Path) -> None:
    t = _minimal(root)
    (t.sys / "devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1/size").unlink()
    t.finish()


def cxl_missing_region(root: Path) -> None:
    t = _minimal(root)
    t.numa(1, "", 4 * GiB, "20 10")
    t.cxl_region(0, node=1, size=4 * GiB, mems=[(0, "0x1", 4 * GiB)])
    (t.sys / "bus/cxl/devices/region0").unlink()
    t.finish()


def no_nodes(root: Path) -> None:
    t = Tree(root)
    # A file keeps devices/system in git (which drops empty directories); node/ is what is missing.
    (t.sys / "devices/system/cpu").mkdir(parents=True)
    (t.sys / "devices/system/cpu/online").write_text("0-1\n")
    t.finish()


CASES = {
    "two-socket-cxl": two_socket_cxl, "dram-only": dram_only, "bad-meminfo": bad_meminfo,
    "bad-cpulist": bad_cpulist, "bad-nsid": bad_nsid, "missing-size": missing_size,
    "cxl-missing-region": cxl_missing_region, "no-nodes": no_nodes,
}


def main() -> None:
    for name, build in CASES.items():
        root = DATA / name
        shutil.rmtree(root, ignore_errors=True)
        build(root)
        print(f"wrote {root}")


if __name__ == "__main__":
    main()
