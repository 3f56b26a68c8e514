"""Directories a run owns while it lives (its scratch directory, a partial output), marked so that a later
run can remove what a killed one left and never touch what a live one holds.

Beside each owned directory `D` lies `D.owner`: created before anything is written into `D`, locked with an
exclusive `flock` for as long as the owner holds it, and naming the owner (pid, boot id, process start time).
The kernel drops a `flock` when its holder dies however it dies (SIGKILL, OOM killer), so "the lock can be
taken" is the test that the owner is gone; the record is a second check, so that a process that is alive
with that pid on this boot is never taken for dead. A directory without an owner file is never removed: it
is still being made, or predates these files.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUFFIX", "Ownership", "own", "reclaim"]

SUFFIX = ".owner"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def _record() -> dict[str, object]:
    pid = os.getpid()
    return {"pid": pid, "boot_id": _boot_id(), "start_time": _start_time(pid)}


@dataclass
class Ownership:
    """This process's hold on `directory` (released on `release`, or by the kernel when the process ends)."""

    directory: Path
    fd: int

    @property
    def lock_file(self) -> Path:
        return self.directory.with_name(self.directory.name + SUFFIX)

    def release(self) -> None:
        """Give the directory up: its owner file goes (the directory itself is the caller's to remove or keep)."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.lock_file.unlink()
        os.close(self.fd)
        self.fd = -1


def own(directory: Path) -> Ownership:
    """Mark `directory` (which need not exist yet) as this process's for as long as it lives."""
    lock_file = directory.with_name(directory.name + SUFFIX)
    # O_CLOEXEC: a program this run starts (a compiler, a launcher) must not keep the lock after it is gone.
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(_record()).encode())
    except BaseException:
        os.close(fd)
        lock_file.unlink()
        raise
    return Ownership(directory, fd)


def _owner_alive(record: dict[str, object]) -> bool:
    """Whether the recorded owner is a process alive now (same pid, boot and start time)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or record.get("boot_id") != _boot_id():
        return False
    started = _start_time(pid)
    return started is not None and started == record.get("start_time")


def _dead(lock_file: Path, fd: int) -> bool:
    """Whether the owner of `lock_file` (opened as `fd`) is gone; on True this process holds its lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its owner holds it: alive
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return False  # locked and not yet written: being made this instant
    return isinstance(record, dict) and not _owner_alive(record)


def reclaim(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories under `parent` named `prefix*` whose owner is dead; the ones removed."""
    removed: list[Path] = []
    try:
        lock_files = sorted(parent.glob(f"{prefix}*{SUFFIX}"))
    except OSError:
        return removed
    for lock_file in lock_files:
        try:
            fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # released meanwhile
        try:
            if _dead(lock_file, fd):
                directory = lock_file.with_name(lock_file.name.removesuffix(SUFFIX))
                shutil.rmtree(directory, ignore_errors=True)
                if not directory.exists():
                    lock_file.unlink()
                    removed.append(directory)
        finally:
            os.close(fd)
    return removed
