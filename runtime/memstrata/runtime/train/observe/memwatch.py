"""What a run costs in memory and storage, measured from outside the training code.

- Peak RSS of the whole process tree (this process and every descendant,
  summed), sampled in a background thread: DeepSpeed may start helper processes
  (compilers, probes). In a pod (`cgroup=True`), the container's memory cgroup's
  own peak instead, which the kernel keeps exactly and the pod's limit is held
  against: summed over two ranks, the tree's PSS said 5.9 GB where the cgroup
  peaked at 4.6 GB.
- Bytes this process moved to and from storage, from `/proc/self/io`
  (`write_bytes` / `read_bytes` count what reached the block layer, including
  DeepSpeed's O_DIRECT swap I/O from its aio threads).
- The swap directory itself: how many files and bytes it holds, at most.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from pydantic import BaseModel

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class IoCounters(BaseModel):
    read_bytes: int = 0
    write_bytes: int = 0

    def __sub__(self, other: "IoCounters") -> "IoCounters":
        return IoCounters(read_bytes=self.read_bytes - other.read_bytes,
                          write_bytes=self.write_bytes - other.write_bytes)


class DirUsage(BaseModel):
    files: int = 0
    bytes: int = 0


def process_io(pid: int | str = "self") -> IoCounters:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return IoCounters(read_bytes=int(fields["read_bytes"]), write_bytes=int(fields["write_bytes"]))


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process exited since its parent listed it
        return kids
    for task in tasks:
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread exited between listing and reading
            continue
    return kids


def _rss(pid: int) -> int:
    try:
        # statm's second field is resident pages; cheaper to parse than status.
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def _status_bytes(pid: int, key: str) -> int:
    """One `key:  N kB` line of /proc/<pid>/status, in bytes (0 when the process or the line is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _hwm(pid: int) -> int:
    """The kernel's exact high-water mark of one process's RSS (VmHWM): catches spikes between samples."""
    return _status_bytes(pid, "VmHWM")


def _rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _own_pss(pid: int) -> int:
    """Anonymous and shared-memory pages by PSS: split only among the processes that hold them, which here are the
    tree's own (copy-on-write after a fork, shared memory between ranks), never another program's."""
    rollup = _rollup(pid)
    if "Pss_Anon" not in rollup:  # a kernel before 5.14 has no split: all of PSS
        return rollup.get("Pss", 0)
    return rollup["Pss_Anon"] + rollup.get("Pss_Shmem", 0)


def _rss_file(pid: int) -> int:
    return _status_bytes(pid, "RssFile")


def tree_rss(root: int) -> int:
    """Resident bytes of `root` plus those of all its descendants.

    With descendants: the root's file pages (its libraries: torch's alone are about 0.5 GB) once, as its RSS counts
    them, plus every process's anonymous and shared memory by PSS. A child forked from a 1 GB trainer (a compiler
    probe, DeepSpeed's `numactl --hardware`) shares all its pages with the parent until it execs: RSS would count
    them twice, PSS splits them between the two. File pages are not taken by PSS, which divides a library's pages
    among every process on the machine that maps it, so the tree's sum moved by hundreds of MB with whatever else ran
    (two memwatch tests failed beside another torch process); the ranks map the root's libraries. Alone, the root
    counts by RSS, the same and far cheaper to read.
    """
    children = _children(root)
    if not children:
        return _rss(root)
    total, todo, seen = _rss_file(root), [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _own_pss(pid)
        todo += _children(pid)
    return total


def dir_usage(path: Path) -> DirUsage:
    """Files under `path` and their allocated bytes (st_blocks: what the disk really holds)."""
    usage = DirUsage()
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            usage.files += 1
            usage.bytes += st.st_blocks * 512
    return usage


def cgroup_peak_files(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> list[Path]:
    """Where the kernel keeps the peak of the memory cgroup a process is in (its /proc/<pid>/cgroup text), in the
    order to try: v2 `memory.peak`, v1 `memory.max_usage_in_bytes`, each at the cgroup's path and then at the
    mount's root (in a container without its own cgroup namespace, the container's cgroup is mounted there while
    the path names the host's hierarchy)."""
    files: list[Path] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        rel = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":
            files += [root / rel / "memory.peak", root / "memory.peak"]
        elif "memory" in controllers.split(","):
            files += [root / "memory" / rel / "memory.max_usage_in_bytes",
                      root / "memory" / "memory.max_usage_in_bytes"]
    return [f for i, f in enumerate(files) if f not in files[:i]]


def own_cgroup_peak() -> int | None:
    """The peak memory use of this process's memory cgroup, as the kernel counted it; None where it cannot be read
    (no memory controller, or a hierarchy root, which keeps no peak)."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for path in cgroup_peak_files(text):
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            continue
    return None


class MemWatch:
    """Samples tree RSS and swap-directory usage every `interval` seconds until stopped; keeps the peaks.
    `cgroup`: the memory peak is this process's memory cgroup's (a pod's container), where it can be read."""

    def __init__(self, swap_dir: Path | None, interval: float = 0.05, root_pid: int | None = None,
                 cgroup: bool = False) -> None:
        self.swap_dir = swap_dir
        self.cgroup = cgroup
        self.interval = interval
        self.root_pid = root_pid or os.getpid()
        self.peak_rss = 0
        self.peak_swap = DirUsage()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io_start = IoCounters()

    def sample(self) -> None:
        kernel = own_cgroup_peak() if self.cgroup else None
        if kernel is not None:
            self.peak_rss = max(self.peak_rss, kernel)
        else:
            self.peak_rss = max(self.peak_rss, tree_rss(self.root_pid), _hwm(self.root_pid))
        if self.swap_dir is not None and self.swap_dir.exists():
            now = dir_usage(self.swap_dir)
            if now.bytes > self.peak_swap.bytes or now.files > self.peak_swap.files:
                self.peak_swap = DirUsage(files=max(now.files, self.peak_swap.files),
                                          bytes=max(now.bytes, self.peak_swap.bytes))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except OSError:  # a process or file vanished mid-walk; the next sample sees the new state
                continue

    def start(self) -> "MemWatch":
        self._io_start = process_io()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="memstrata-memwatch", daemon=True)
        self._thread.start()
        return self

    def io(self) -> IoCounters:
        """Storage bytes read and written by this process since start()."""
        return process_io() - self._io_start

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
