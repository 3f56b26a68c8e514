"""MemWatch measures what a user would: the whole process tree's RSS and real storage traffic."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from memstrata.runtime.train.observe.memwatch import MemWatch, cgroup_peak_files, dir_usage, process_io, tree_rss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))  # skip loudly, fail under CI=true
from native_helpers import child_env, unavailable  # noqa: E402

MiB = 1 << 20


def test_tree_rss_includes_children() -> None:
    alone = tree_rss(os.getpid())
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); "
                              "print('ready', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        watch = MemWatch(None, interval=0.01).start()
        time.sleep(0.1)
        watch.stop()
        assert watch.peak_rss >= alone + 300 * MiB
    finally:
        child.kill()
        child.wait()


def test_io_and_dir_usage_count_real_writes(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    watch = MemWatch(swap, interval=0.01).start()
    with open(swap / "a.swp", "wb") as f:
        f.write(os.urandom(8 * MiB))
        f.flush()
        os.fsync(f.fileno())
    (swap / "sub").mkdir()
    (swap / "sub" / "b.swp").write_bytes(b"y" * MiB)
    time.sleep(0.1)
    watch.stop()
    assert watch.io().write_bytes >= 8 * MiB
    assert watch.peak_swap.files == 2 and watch.peak_swap.bytes >= 9 * MiB
    (swap / "a.swp").unlink()
    assert dir_usage(swap).files == 1
    assert watch.peak_swap.files == 2, "peaks are kept after files go away"


def test_process_io_reads_proc() -> None:
    io = process_io()
    assert io.read_bytes >= 0 and io.write_bytes >= 0


def test_a_forked_child_that_shares_the_parents_pages_is_not_counted_twice() -> None:
    """DeepSpeed's CPU accelerator forks `numactl --hardware` from the trainer mid-run: until it execs, the child
    shares every page of the trainer, which the tree's peak must count once."""
    held = bytearray(400 << 20)
    held[::4096] = b"x" * len(held[::4096])
    alone = tree_rss(os.getpid())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds the parent's pages (copy-on-write) and never execs
        os.close(r)
        os.write(w, b"1")
        time.sleep(30)
        os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 1) == b"1"
        together = tree_rss(os.getpid())
        assert together < alone + 64 * MiB, (alone, together)
        assert together > alone - 64 * MiB  # and the parent's pages are all still counted
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)


def test_the_cgroup_peak_is_found_where_the_kernel_keeps_it() -> None:
    root = Path("/sys/fs/cgroup")
    v1 = "4:memory:/kubepods/burstable/pod1/c1\n0::/\n"
    assert cgroup_peak_files(v1, root)[:2] == [root / "memory/kubepods/burstable/pod1/c1/memory.max_usage_in_bytes",
                                               root / "memory/memory.max_usage_in_bytes"]
    v2 = "0::/kubepods.slice/pod1/c1\n"
    assert cgroup_peak_files(v2, root) == [root / "kubepods.slice/pod1/c1/memory.peak", root / "memory.peak"]
    assert cgroup_peak_files("0::/\n", root) == [root / "memory.peak"]  # a container with its own namespace
    assert cgroup_peak_files("1:cpu,cpuacct:/x\n", root) == []  # no memory controller: the tree is measured


def test_in_a_pods_cgroup_two_ranks_peak_is_the_cgroups_own() -> None:
    """Two ranks in one container: the node's DRAM peak is what the kernel counted for the container's cgroup
    (what its limit is held against), not a sum over processes (two ranks' PSS said 5.9 GB where it was 4.6)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "offload"))
    from memcap import DramCap  # the benchmarks' cgroup, v1 or v2

    cap, why = DramCap.open(f"memwatch-{os.getpid()}", 2 << 30)
    if cap is None:
        unavailable(f"no memory cgroup can be made here: {why}")
    script = ("import json, subprocess, sys, time\n"
              "from memstrata.runtime.train.observe.memwatch import MemWatch, own_cgroup_peak\n"
              "watch = MemWatch(None, interval=0.01, cgroup=True).start()\n"
              "rank = 'b = bytearray(200 << 20); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(0.5)'\n"
              "ranks = [subprocess.Popen([sys.executable, '-c', 'import time; ' + rank]) for _ in range(2)]\n"
              "[r.wait() for r in ranks]\n"
              "watch.stop()\n"
              "print(json.dumps({'peak': watch.peak_rss, 'kernel': own_cgroup_peak()}))\n")
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              preexec_fn=cap.preexec, env=child_env())
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.splitlines()[-1])
        assert seen["peak"] == seen["kernel"] == cap.peak_bytes(), seen
        assert seen["peak"] >= 400 * MiB, seen
    finally:
        cap.close()
