"""The same DRAM cap for every contender: a cgroup memory group per run, v2 or v1, whichever the machine has.

cgroup v2 (the unified hierarchy at /sys/fs/cgroup, its cgroup.controllers listing "memory"): a child group
with `memory.max` (and `memory.swap.max` 0 where swap accounting exists); the peak is `memory.peak` where the
kernel has it (5.19+), the OOM kills are `oom_kill` in `memory.events`.
cgroup v1 (/sys/fs/cgroup/memory): `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`), the peak
`memory.max_usage_in_bytes` (RSS plus the page cache charged to the group), OOM kills `oom_kill` in
`memory.oom_control`.
The contender's process joins the group in `preexec` (between fork and exec), so every byte it and its
children allocate is charged and capped. Where neither is usable, `DramCap.open` says why and the
benchmark records the cap as not enforced instead of pretending.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
GROUP_DIR = "memstrata-bench"


def keyed(text: str) -> dict[str, int]:
    """The `key value` lines of memory.events / memory.oom_control (non-numeric values skipped)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def v2_has_memory(root: Path) -> bool:
    """Whether `root` is a cgroup v2 hierarchy whose memory controller can be used."""
    ctl = root / "cgroup.controllers"
    return ctl.is_file() and "memory" in ctl.read_text().split()


def _enable_memory_for_children(root: Path) -> None:
    """v2 hands a controller to a group's children only when the parent's subtree_control names it."""
    sub = root / "cgroup.subtree_control"
    if sub.is_file() and "memory" not in sub.read_text().split():
        sub.write_text("+memory")


class DramCap:
    """One capped group. `version` is 1 or 2; the file names differ, nothing else does."""

    FILES = {1: {"limit": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes",
                 "peak": "memory.max_usage_in_bytes", "oom": "memory.oom_control"},
             2: {"limit": "memory.max", "swap": "memory.swap.max", "peak": "memory.peak", "oom": "memory.events"}}

    def __init__(self, path: Path, limit_bytes: int, version: int) -> None:
        self.path, self.limit_bytes, self.version = path, limit_bytes, version
        self.files = self.FILES[version]

    @property
    def mechanism(self) -> str:
        f = self.files
        return (f"cgroup v{self.version} memory group per contender ({f['limit']}); peak from {f['peak']}, "
                f"OOM kills from {f['oom']}")

    @classmethod
    def open(cls, name: str, limit_bytes: int, root: Path = CGROUP) -> tuple[DramCap | None, str]:
        """A fresh group capped at `limit_bytes` (v2 if the machine has it, else v1), or None and why not."""
        tried = []
        if v2_has_memory(root):
            parent = root / GROUP_DIR
            try:
                _enable_memory_for_children(root)
                parent.mkdir(exist_ok=True)
                _enable_memory_for_children(parent)
            except OSError as exc:
                tried.append(f"cgroup v2 at {root}: cannot delegate the memory controller: {exc}")
            else:
                return cls._create(parent / f"{name}-{os.getpid()}", limit_bytes, 2)
        else:
            tried.append(f"no cgroup v2 memory controller ({root / 'cgroup.controllers'} does not list memory)")
        v1 = root / "memory"
        if (v1 / "memory.limit_in_bytes").exists():
            return cls._create(v1 / GROUP_DIR / f"{name}-{os.getpid()}", limit_bytes, 1)
        tried.append(f"no cgroup v1 memory controller at {v1}")
        return None, "; ".join(tried)

    @classmethod
    def _create(cls, path: Path, limit_bytes: int, version: int) -> tuple[DramCap | None, str]:
        files = cls.FILES[version]
        try:
            path.mkdir(parents=True, exist_ok=False)
            (path / files["limit"]).write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # absent without swap accounting; then there is no swap to cap
                (path / files["swap"]).write_text("0" if version == 2 else str(limit_bytes))
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None, f"cannot create a capped cgroup v{version} group at {path}: {exc}"
        return cls(path, limit_bytes, version), ""

    def preexec(self) -> None:
        """Run in the child before exec: join the group, so the whole process tree is capped."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        """The group's peak charge; None on a v2 kernel without memory.peak."""
        peak = self.path / self.files["peak"]
        return int(peak.read_text()) if peak.exists() else None

    def oom_killed(self) -> bool:
        return keyed((self.path / self.files["oom"]).read_text()).get("oom_kill", 0) > 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()  # the group is empty once its processes have exited
