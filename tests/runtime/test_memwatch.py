"""MemWatch measures what a user would: the whole process tree's RSS and real storage traffic."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from memstrata.runtime.train.memwatch import MemWatch, dir_usage, process_io, tree_rss

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
