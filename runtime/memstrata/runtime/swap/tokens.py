"""I/O tokens: at most `limit` ranks of one node do I/O on one stratum at a time.

MLP-Offload found that ranks hammering the same NVMe path at once slow each
other down; a per-stratum token bounds the concurrency. A token is an
exclusive flock on one of `limit` files under /dev/shm: flock is shared by
every process on the node, needs no daemon, and the kernel drops a lock the
moment its holder dies, so a rank killed with `kill -9` never strands one.
"""
from __future__ import annotations

import fcntl
import os
import re
import time
from pathlib import Path

__all__ = ["IoTokens"]

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


class IoTokens:
    """A counting semaphore of `limit` tokens for `stratum`, shared by the processes of a node."""

    def __init__(self, stratum: str, limit: int, *, rank: int = 0, root: str | Path = "/dev/shm") -> None:
        if limit < 1:
            raise ValueError(f"I/O token limit for stratum {stratum!r} must be at least 1, got {limit}")
        if not _NAME.match(stratum):
            raise ValueError(f"stratum name {stratum!r} must be letters, digits, '.', '_' or '-'")
        self.stratum, self.limit, self.rank = stratum, limit, rank
        self.root = Path(root)
        self._fds: list[int] = []
        self._held: int | None = None
        self._depth = 0  # a rank's swappers share its one token: nested acquires count, not block
        self.wait_seconds = 0.0  # time spent waiting for a token: the cost of the bound
        self.acquisitions = 0
        self.bypasses = 0  # bounded waits that ran out: I/O done without a token rather than a deadlock

    def _open(self) -> list[int]:
        if not self._fds:
            for i in range(self.limit):
                path = self.root / f"memstrata-io-{self.stratum}-{i}of{self.limit}"
                self._fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        return self._fds

    def acquire(self, timeout_s: float | None = None) -> bool:
        """Take a token (nested calls share the one held); False when `timeout_s` passed without one, and then
        nothing is held. A bounded wait is how a rank escapes a peer that holds the token while it waits in a
        collective for this rank: the bound is exceeded, never deadlocked (`bypasses` counts it)."""
        if self._held is not None:
            self._depth += 1
            return True
        fds = self._open()
        t0 = time.monotonic()
        # Start at a rank-dependent slot so ranks spread over tokens; poll the
        # others without blocking, then block briefly on our own slot.
        first = self.rank % self.limit
        order = [(first + k) % self.limit for k in range(self.limit)]
        while True:
            for i in order:
                try:
                    fcntl.flock(fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                self._held = i
                self._depth += 1
                self.wait_seconds += time.monotonic() - t0
                self.acquisitions += 1
                return True
            if timeout_s is not None and time.monotonic() - t0 >= timeout_s:
                self.wait_seconds += time.monotonic() - t0
                self.bypasses += 1
                return False
            time.sleep(0.0005)

    def release(self) -> None:
        if self._depth > 0:
            self._depth -= 1
        if self._held is None or self._depth > 0:
            return
        fcntl.flock(self._fds[self._held], fcntl.LOCK_UN)
        self._held = None

    @property
    def held(self) -> bool:
        return self._held is not None

    def close(self) -> None:
        self._depth = 0
        self.release()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> IoTokens:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
