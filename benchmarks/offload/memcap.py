"""The same DRAM cap for every contender: a cgroup v1 memory group per run.

These machines mount cgroup v1 (no memory.peak, no memory.max); its memory
controller still enforces `memory.limit_in_bytes` and records
`memory.max_usage_in_bytes` (RSS plus the page cache charged to the group).
The contender's process joins the group in `preexec` (between fork and exec),
so every byte it and its children allocate is charged and capped. Where the
controller is missing or not writable, `DramCap.open` says why and the
benchmark records the cap as not enforced instead of pretending.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


class DramCap:
    def __init__(self, path: Path, limit_bytes: int) -> None:
        self.path, self.limit_bytes = path, limit_bytes

    @classmethod
    def open(cls, name: str, limit_bytes: int) -> tuple[DramCap | None, str]:
        """A fresh group capped at `limit_bytes`, or None and the reason it cannot be had."""
        if not (ROOT / "memory.limit_in_bytes").exists():
            return None, f"no cgroup v1 memory controller at {ROOT}"
        path = ROOT / "memstrata-bench" / f"{name}-{os.getpid()}"
        try:
            path.mkdir(parents=True, exist_ok=False)
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # absent without swap accounting; there is no swap here anyway
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None, f"cannot create a capped group under {ROOT}: {exc}"
        return cls(path, limit_bytes), ""

    def preexec(self) -> None:
        """Run in the child before exec: join the group, so the whole process tree is capped."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_killed(self) -> bool:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1]) > 0
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()  # the group is empty once its processes have exited
