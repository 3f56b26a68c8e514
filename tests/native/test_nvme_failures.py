"""Failures a user must see as one clean exception: kill -9, refusals, no space, real I/O errors."""
from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from native_helpers import child_env, need_tool, run, unavailable

from memstrata.node import nvmescan
from memstrata.node.discovery import dev_heads
from memstrata.node.header import MAGIC, State, parse_header
from memstrata.node.safety import DeviceUnsafeError, parse_mounts, parse_swaps, read_head
from memstrata.node.sysfs import SysfsTree
from memstrata.runtime import _native
from memstrata.runtime.strata.errors import NvmeError
from memstrata.runtime.strata.nvme import NvmeEngine

MiB = 1 << 20

KILLED_WRITER = textwrap.dedent("""
    import os, sys
    from memstrata.runtime.strata.nvme import NvmeEngine
    eng = NvmeEngine.open([sys.argv[1]], job="t/killed", queue_depth=8)
    exts = [eng.allocate(4 << 20) for _ in range(12)]
    buf = os.urandom(4 << 20)
    print("writing", flush=True)
    while True:
        for h in [eng.write(e, buf) for e in exts]:
            eng.wait(h)
""")


@pytest.mark.loopdev
def test_kill_9_mid_write_leaks_no_space(loopdev) -> None:
    dev = loopdev(64 * MiB)
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, dev], stdout=subprocess.PIPE, text=True,
                             env=child_env())
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
        time.sleep(0.5)  # writes of 48 MiB are in flight
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    stale = parse_header(read_head(dev, 4096))
    assert stale is not None and stale.state == State.OPEN and stale.owner_job == "t/killed"
    with NvmeEngine.open([dev], job="t/next") as eng:
        assert [(p, h.owner_job, h.owner_pid) for p, h in eng.recovered] == [(dev, "t/killed", child.pid)]
        space = eng.stats()[0].space
        assert space.free_bytes == space.capacity_bytes and space.free_extents == 1
        eng.allocate(space.capacity_bytes)  # the whole device really is free
    fresh = parse_header(read_head(dev, 4096))
    assert fresh is not None and fresh.generation == stale.generation + 1 and fresh.state == State.SCRUBBED


@pytest.mark.loopdev
def test_refuses_loop_device_with_ext4_unless_forced_and_never_when_mounted(loopdev, tmp_path: Path) -> None:
    need_tool("mkfs.ext4", "e2fsprogs")
    dev = loopdev(64 * MiB)
    run("mkfs.ext4", "-q", "-F", dev)
    with pytest.raises(DeviceUnsafeError, match=rf"{dev}: refusing to use it: foreign signature: ext4") as info:
        NvmeEngine.open([dev], job="t/ext4")
    # One except clause catches every engine failure, refusals included, with the device named.
    assert isinstance(info.value, NvmeError) and info.value.device == dev
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run("mount", dev, str(mnt))
    try:
        with pytest.raises(DeviceUnsafeError, match=rf"mounted at {mnt}"):
            NvmeEngine.open([dev], job="t/ext4", force=True)
    finally:
        run("umount", str(mnt))
    with NvmeEngine.open([dev], job="t/ext4", force=True) as eng:  # force overrides only the signature
        assert eng.stats()[0].space.free_bytes > 0


@pytest.mark.loopdev
def test_refuses_loop_device_with_gpt_and_with_partitions_even_when_forced(loopdev) -> None:
    need_tool("sgdisk", "gdisk")
    dev = loopdev(64 * MiB)
    run("sgdisk", "-o", dev)
    with pytest.raises(DeviceUnsafeError, match=r"foreign signature: gpt \(GPT partition table\)"):
        NvmeEngine.open([dev], job="t/gpt")
    parted = loopdev(64 * MiB, partscan=True)
    run("sgdisk", "-o", "-n", "1:2048:+8M", parted)
    run("partx", "-u", parted)  # make sure the kernel has re-read the table
    name = os.path.basename(parted)
    with pytest.raises(DeviceUnsafeError, match=rf"has partitions \({name}p1\)"):
        NvmeEngine.open([parted], job="t/gpt", force=True)


def discovery_reasons(dev: str) -> list[str]:
    """What the node agent's discovery says about `dev`, read the way it reads a node."""
    mounts = parse_mounts(Path("/proc/self/mountinfo").read_text())
    swaps = parse_swaps(Path("/proc/swaps").read_text())
    found = nvmescan.problems(SysfsTree("/sys"), os.path.basename(dev), dev_heads("/dev"), mounts, swaps)
    return [p.reason for p in found]


@pytest.mark.loopdev
def test_read_only_device_is_refused_by_discovery_and_engine_even_forced(loopdev) -> None:
    dev = loopdev(16 * MiB, read_only=True)
    assert discovery_reasons(dev) == ["read-only"]
    with pytest.raises(DeviceUnsafeError, match=rf"^{dev}: refusing to use it: read-only$"):
        NvmeEngine.open([dev], job="t/ro", force=True)


@pytest.mark.loopdev
def test_active_swap_is_refused_by_discovery_and_engine_even_forced(loopdev) -> None:
    need_tool("mkswap", "util-linux")
    dev = loopdev(16 * MiB)
    run("mkswap", dev)
    on = subprocess.run(["swapon", dev], capture_output=True, text=True, timeout=60)
    if on.returncode != 0:
        unavailable(f"swapon {dev} is not permitted here: {on.stderr.strip()}")
    try:
        assert discovery_reasons(dev) == ["foreign signature: swap", f"active swap ({dev})"]
        with pytest.raises(DeviceUnsafeError, match=rf"^{dev}: refusing to use it: active swap \({dev}\)$"):
            NvmeEngine.open([dev], job="t/swap", force=True)
    finally:
        subprocess.run(["swapoff", dev], capture_output=True, timeout=120)


@pytest.mark.loopdev
def test_gpt_written_over_memstrata_header_is_refused_by_discovery_and_engine(loopdev) -> None:
    need_tool("sgdisk", "gdisk")
    dev = loopdev(64 * MiB)
    NvmeEngine.open([dev], job="t/before").close()
    run("sgdisk", "-o", dev)  # keeps the boot-code bytes: memstrata's magic still leads the device
    assert read_head(dev, 4096).startswith(MAGIC)
    assert discovery_reasons(dev) == ["foreign signature: gpt (GPT partition table)"]
    with pytest.raises(DeviceUnsafeError, match=rf"^{dev}: refusing to use it: foreign signature: gpt"):
        NvmeEngine.open([dev], job="t/after")


@pytest.mark.loopdev
def test_forced_open_leaves_no_foreign_signature_behind(loopdev) -> None:
    # btrfs's superblock sits at 64 KiB, behind memstrata's 4 KiB header: a forced open
    # must wipe it, or memstrata's own device would be refused from then on.
    need_tool("mkfs.btrfs", "btrfs-progs")
    dev = loopdev(256 * MiB)
    run("mkfs.btrfs", "-q", "-f", dev)
    assert discovery_reasons(dev) == ["foreign signature: btrfs"]
    NvmeEngine.open([dev], job="t/forced", force=True).close()
    assert discovery_reasons(dev) == []
    with NvmeEngine.open([dev], job="t/next") as eng:
        assert eng.stats()[0].space.free_bytes > 0


def test_out_of_space_is_clean_and_leaves_nothing_allocated(tmp_path: Path) -> None:
    paths = []
    for i in range(2):
        p = tmp_path / f"d{i}.img"
        with open(p, "wb") as f:
            f.truncate(17 * MiB)
        paths.append(str(p))
    with NvmeEngine.open(paths, job="t/enospc", stripe_bytes=MiB) as eng:
        before = [s.space for s in eng.stats()]
        with pytest.raises(NvmeError, match=r"out of space: need \d+ bytes, 16777216 free") as info:
            eng.allocate(40 * MiB)
        assert info.value.errno == errno.ENOSPC and info.value.device in paths
        assert [s.space for s in eng.stats()] == before  # nothing half-allocated on the other device
        eng.allocate(32 * MiB)  # exactly the capacity of both
        with pytest.raises(NvmeError, match="out of space"):
            eng.allocate(1)


@pytest.mark.loopdev
def test_real_io_error_from_a_full_tmpfs_surfaces_as_a_clean_exception(small_tmpfs, loopdev) -> None:
    backing = small_tmpfs(4 * MiB)
    dev = loopdev(64 * MiB, backing_dir=backing)
    with NvmeEngine.open([dev], job="t/eio") as eng:
        ext = eng.allocate(32 * MiB)
        with pytest.raises(NvmeError) as info:
            eng.wait(eng.write(ext, os.urandom(32 * MiB)))
        err = info.value
        assert err.errno in (errno.EIO, errno.ENOSPC), err
        assert err.device == dev and err.offset is not None and err.length and str(err).startswith(dev)
        assert eng.stats()[0].errors >= 1
        small = eng.allocate(4096)  # the engine is still usable afterwards (reads of holes need no space)
        out = bytearray(b"x" * 4096)
        eng.wait(eng.read(small, out))
        assert out == bytes(4096)


@pytest.mark.parametrize("backend", ["io_uring", "threads"])  # the thread path reports it as the ring does
def test_device_that_shrinks_under_the_engine_gives_a_short_read_error(tmp_path: Path, backend: str) -> None:
    p = tmp_path / "vanishing.img"
    with open(p, "wb") as f:
        f.truncate(16 * MiB)
    with NvmeEngine.open([str(p)], job="t/gone", io_backend=backend) as eng:
        eng.allocate(8 * MiB)
        tail = eng.allocate(4 * MiB)
        eng.wait(eng.write(tail, os.urandom(4 * MiB)))
        os.truncate(p, 2 * MiB)
        with pytest.raises(NvmeError, match=r"short read: 0 of \d+ bytes") as info:
            eng.wait(eng.read(tail, bytearray(4 * MiB)))
        assert info.value.errno == errno.EIO and info.value.offset == tail.bases[0]
        assert eng.stats()[0].errors >= 1


def test_misaligned_direct_io_reports_einval_never_silent_success(tmp_path: Path) -> None:
    # DeepSpeed's aio handle returns success for an unaligned write that wrote
    # nothing; the ring hands back -EINVAL and the engine never issues one.
    p = tmp_path / "raw.img"
    with open(p, "wb") as f:
        f.truncate(MiB)
    fd = os.open(p, os.O_RDWR | os.O_DIRECT)
    try:
        ring = _native.Ring(4, [fd])
        buf = mmap.mmap(-1, 8192)
        ring.submit(True, 0, memoryview(buf)[1:1001], 0, 1)
        ring.submit(True, 0, memoryview(buf)[:4096], 100, 2)
        assert sorted(ring.wait(-1)) == [(1, -errno.EINVAL), (2, -errno.EINVAL)]
        ring.close()
    finally:
        os.close(fd)


def test_second_engine_on_a_device_in_use_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "shared.img"
    with open(p, "wb") as f:
        f.truncate(8 * MiB)
    with NvmeEngine.open([str(p)], job="t/a"):
        with pytest.raises(NvmeError, match="in use by another memstrata engine"):
            NvmeEngine.open([str(p)], job="t/b", busy_timeout_s=0.2)


AS_POD_USER = textwrap.dedent("""
    import os, sys
    from memstrata.node.safety import DeviceUnsafeError
    from memstrata.runtime.strata.nvme import NvmeEngine
    dev, groups = sys.argv[1], [int(g) for g in sys.argv[2].split(",") if g]
    os.setgroups(groups); os.setgid(1000); os.setuid(1000)  # the training container's user (after imports)
    try:
        NvmeEngine.open([dev], job="t/access", force=True).close()
        print("opened")
    except DeviceUnsafeError as e:
        print(f"refused: {e}")
""")


@pytest.mark.loopdev
def test_a_namespace_the_pods_user_may_not_open_is_refused_saying_who_and_why_even_forced(loopdev) -> None:
    """A node without udev's rules leaves block devices root:root 0600; a pod that meets one (its node agent
    started before the rules changed) fails at once naming the device, its ownership and the process's ids."""
    dev = loopdev(16 * MiB)

    def as_pod(groups: str) -> str:
        done = subprocess.run([sys.executable, "-c", AS_POD_USER, dev, groups], capture_output=True, text=True,
                              timeout=120, env=child_env())
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    os.chown(dev, 0, 0)
    os.chmod(dev, 0o600)
    assert as_pod("6") == (f"refused: {dev}: refusing to use it: this process (uid 1000, groups 1000,6) may not "
                           "open it for reading and writing (Permission denied): it is owned by 0:0 with mode 0600, "
                           "and the node's block devices should be root:disk 0660 (udev's default rules)")
    os.chown(dev, 0, 6)
    os.chmod(dev, 0o660)
    assert as_pod("6") == "opened"
    assert as_pod("").startswith(f"refused: {dev}: refusing to use it: this process (uid 1000, groups 1000) may not")
