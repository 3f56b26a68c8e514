"""The QEMU guest really is the node memstrata is built for: a CPU-less CXL NUMA node in a
lower memory tier, a memory-only node, and an NVMe controller whose four namespaces are
free, ext4, partitioned and device-mapper-held. Run with `make test-guest`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from memstrata.node.sysfs import parse_list

from guest import GuestError, GuestResult, run_in_guest

pytestmark = [pytest.mark.guest, pytest.mark.slow]


def _tier_of(tiers: dict[str, str], node: int) -> int:
    for name, nodelist in tiers.items():
        if node in _parse_list(nodelist):
            return int(name.removeprefix("memory_tier"))
    raise AssertionError(f"node {node} is in no memory tier: {tiers}")


def _parse_list(text: str) -> set[int]:
    return set(parse_list(text))


def _cxl_node(facts: dict) -> int:
    kmem = [d for d in facts["cxl"]["dax"].values() if d["driver"] == "kmem"]
    assert len(kmem) == 1, f"expected one dax device bound to kmem, got {facts['cxl']['dax']}"
    return int(kmem[0]["target_node"])


def test_cxl_region_is_committed_and_backs_a_numa_node(facts: dict) -> None:
    regions = facts["cxl"]["regions"]
    assert len(regions) == 1, f"expected one CXL region, got {facts['cxl']['devices']}"
    (region,) = regions.values()
    assert region["commit"] == "1" and region["driver"] == "cxl_region", region
    assert int(region["size"], 0) == int(facts["cxl"]["mems"]["mem0"]["ram_size"], 0) == 512 << 20
    node = _cxl_node(facts)
    assert node not in (0, 1), "the CXL node must be a node of its own, not one QEMU's -numa made"
    assert str(node) in facts["numa"], f"node{node} missing from /sys/devices/system/node"


def test_cxl_node_is_cpuless_in_a_lower_tier_and_allocatable(facts: dict) -> None:
    node = _cxl_node(facts)
    info = facts["numa"][str(node)]
    assert info["cpulist"] == "", f"CXL node{node} has CPUs {info['cpulist']}"
    assert node not in _parse_list(facts["has_cpu"])
    assert 450 << 10 <= info["mem_total_kb"] <= 512 << 10, info
    assert _tier_of(facts["tiers"], node) > _tier_of(facts["tiers"], 0), facts["tiers"]
    assert facts["alloc_node"][str(node)] == node, "libnuma memory bound to the CXL node landed elsewhere"


def test_memory_only_node_has_memory_and_no_cpus(facts: dict) -> None:
    assert _parse_list(facts["numa"]["0"]["cpulist"]) == {0, 1}
    assert facts["numa"]["1"]["cpulist"] == ""
    assert 1 not in _parse_list(facts["has_cpu"])
    assert facts["numa"]["1"]["mem_total_kb"] >= 450 << 10
    assert facts["alloc_node"]["1"] == 1


def _by_nsid(facts: dict) -> dict[int, str]:
    """Visible namespace block devices by nsid: nvme0nY is NOT nsid Y (namespaces are scanned in parallel)."""
    return {int(b["nsid"]): name for name, b in facts["nvme"]["blocks"].items() if b["hidden"] != "1"}


def test_nvme_controller_has_four_namespaces_and_hidden_path_nodes(facts: dict) -> None:
    nvme = facts["nvme"]
    assert nvme["controllers"]["nvme0"]["serial"] == "deadbeef"
    visible = {n: b for n, b in nvme["blocks"].items() if b["hidden"] != "1"}
    assert sorted(visible) == ["nvme0n1", "nvme0n2", "nvme0n3", "nvme0n4"], nvme["blocks"]
    assert sorted(_by_nsid(facts)) == [1, 2, 3, 4]
    # Kernel 6.12 also makes one hidden per-path node per namespace (nvme0c0nY): a
    # consumer that counted them would see eight namespaces and write through a path node.
    hidden = {n for n, b in nvme["blocks"].items() if b["hidden"] == "1"} | set(nvme["path_nodes"])
    assert hidden == {f"nvme0c0n{i}" for i in range(1, 5)}, hidden


def test_namespaces_are_in_the_states_the_safety_rules_distinguish(facts: dict) -> None:
    blocks, sigs = facts["nvme"]["blocks"], facts["signatures"]
    free, ext4, gpt, held = (_by_nsid(facts)[i] for i in (1, 2, 3, 4))
    assert sigs[free]["all_zero_head"] and sigs[free]["blkid"] == ""
    assert blocks[free]["partitions"] == [] and blocks[free]["holders"] == []
    assert sigs[ext4]["ext4_magic"] and "TYPE=ext4" in sigs[ext4]["blkid"]
    assert blocks[gpt]["partitions"] == [f"{gpt}p1"]
    assert sigs[gpt]["gpt_header"] and "PTTYPE=gpt" in sigs[gpt]["blkid"]
    assert blocks[held]["holders"] == ["dm-0"]


def test_repo_is_shared_and_on_the_python_path(facts: dict) -> None:
    mounts = {line.split()[1]: line.split() for line in facts["mounts"].splitlines()}
    assert mounts["/repo"][2] == "9p" and "ro" in mounts["/repo"][3].split(",")
    assert mounts["/out"][2] == "9p" and "rw" in mounts["/out"][3].split(",")
    assert {"/repo/runtime", "/repo/operator"} <= set(facts["sys_path"])
    assert facts["uname"].startswith("6.12") and facts["python"].startswith("3.11")


def test_sysfs_capture_resolves_offline_and_is_small(capture_root: Path, facts: dict) -> None:
    root = capture_root
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    assert size < 2 << 20, f"capture is {size} bytes"
    free, ext4, _, held = (_by_nsid(facts)[i] for i in (1, 2, 3, 4))
    link = root / "sys/block" / free
    assert link.is_symlink() and (link / "nsid").read_text().strip() == "1"
    assert os.path.realpath(link).startswith(str(root.resolve() / "sys/devices"))
    assert (root / "sys/block" / held / "holders/dm-0").is_symlink()
    assert (root / "sys/class/nvme/nvme0/serial").read_text().strip() == "deadbeef"
    head = (root / "dev" / f"{ext4}.head").read_bytes()
    assert len(head) == 4096 and head[1080:1082] == b"\x53\xef"
    cxl_node = _cxl_node(facts)
    assert (root / f"sys/devices/system/node/node{cxl_node}/cpulist").read_text() == "\n"
    assert " /repo 9p " in (root / "proc/mounts").read_text()


def test_script_status_stdout_and_files_come_back(guest_available: None) -> None:
    script = (
        "import os, sys\n"
        "sub = os.path.join(os.environ['MEMSTRATA_OUT'], 'sub')\n"
        "os.makedirs(sub)\n"
        "open(os.path.join(sub, 'n.txt'), 'w').write('42')\n"
        "print('hello from', os.uname().release)\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(7)\n"
    )
    result = run_in_guest(script, timeout=300)
    try:
        assert result.exit_status == 7 and not result.timed_out
        assert result.stdout.startswith("hello from 6.12")
        assert "to stderr" in result.stderr
        assert result.files == {"sub/n.txt": b"42"}
        with pytest.raises(GuestError, match="exited 7"):
            result.check()
    finally:
        shutil.rmtree(result.out_dir, ignore_errors=True)
