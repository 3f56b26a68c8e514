"""The node agent's half of the scrub rule: a namespace a job left dirty is scrubbed before it is offered again.

On every rescan `Scrubber.update` reads the header of each free namespace. One whose header says
a job's data may be on it (memstrata.node.scrub.pending_reason) is in one of two states:

- held exclusively by another process: the raw-NVMe engine of the job that owns it (it opens
  with O_EXCL). It stays Healthy: the kubelet counts it as that pod's, and an Unhealthy device
  that a pod also holds is subtracted twice from what the scheduler thinks is left;
- held by no one: the job is gone and its data is there (it was killed, or an old build closed it
  without scrubbing). From this scan on it is Unhealthy, and it is scrubbed on a thread of its own
  while the agent holds it exclusively, so no engine can take it half scrubbed. When the header
  says SCRUBBED the next scan, asked for at once, offers it Healthy again.

A scrub that fails (the device turned unsafe, an I/O error) is logged naming the device and
retried after `retry_s`; the namespace stays Unhealthy meanwhile. The device plugin also asks
`pending` at Allocate time, so a namespace whose job died since the last scan is refused
rather than handed over with its data.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from memstrata.api.inventory import NodeInventory
from memstrata.node.discovery import dev_heads
from memstrata.node.header import HEADER_BYTES
from memstrata.node.safety import DeviceUnsafeError
from memstrata.node.scrub import ScrubError, hold, pending_reason, scrub_held

if TYPE_CHECKING:
    from memstrata.nodeagent.metrics import AgentMetrics

log = logging.getLogger(__name__)

RETRY_S = 30.0


class Scrubber:
    """Finds the namespaces jobs left dirty and scrubs each on its own thread; the agent's loop never waits.

    The constructor does no I/O."""

    def __init__(self, dev_root: Path, *, sysfs_root: Path, mountinfo: Path, swaps: Path,
                 on_done: Callable[[], None] = lambda: None, retry_s: float = RETRY_S,
                 metrics: AgentMetrics | None = None, marks: Path | None = None) -> None:
        self.dev_root = Path(dev_root)
        # DRA: one empty file per namespace a claim had, from its unprepare until its scrub is done (on the host,
        # so an agent restart keeps it): its pod may have written anything, memstrata's header or not.
        self.marks = Path(marks) if marks is not None else None
        self.metrics = metrics  # None: not counted (`--once`, which needs no metrics library)
        if metrics is not None:
            metrics.devices.scrubbing = lambda: len(self._running)
        self._heads = dev_heads(self.dev_root, HEADER_BYTES)
        self._where = {"sysfs_root": str(sysfs_root), "mountinfo": str(mountinfo), "swaps": str(swaps)}
        self._on_done = on_done
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}
        self._retry_at: dict[str, float] = {}
        self._stopping = threading.Event()
        # Namespaces a process holds exclusively with a job's header on them, as of the last update: in use.
        self.held: frozenset[str] = frozenset()

    def pending(self, name: str) -> str | None:
        """Why namespace `name` may not be handed to a job now; None when it may."""
        try:
            head = self._heads(name)
        except OSError as exc:  # unknown content may be someone's data
            return f"its first blocks are unreadable ({exc.strerror or exc})"
        return pending_reason(head) or self.used(name)

    def used(self, name: str) -> str | None:
        """Why `name` needs a scrub whatever its header says (a claim had it), or None."""
        if self.marks is not None and (self.marks / name).exists():
            return "a DRA claim's pod had it, and may have written anything"
        return None

    def mark(self, names: list[str]) -> None:
        """Remember that a claim had `names` (its unprepare): each is scrubbed before it is offered again."""
        if self.marks is None or not names:
            return
        self.marks.mkdir(parents=True, exist_ok=True)
        for name in names:
            (self.marks / name).touch()

    def update(self, inventory: NodeInventory, *, start: bool = True) -> frozenset[str]:
        """Names of the free namespaces that hold a finished job's data (to be offered Unhealthy).

        Starts a scrub of each that no process holds, unless `start` is False (`--once`) or one
        failed less than `retry_s` ago."""
        dirty: set[str] = set()
        held: set[str] = set()
        for ns in inventory.free_namespaces:
            with self._lock:
                if ns.name in self._running:
                    dirty.add(ns.name)
                    continue
            reason = self.pending(ns.name)
            if reason is None:
                with self._lock:
                    self._retry_at.pop(ns.name, None)
                continue
            with self._lock:
                due = time.monotonic() >= self._retry_at.get(ns.name, 0.0)
            if not due:  # failed a moment ago, and logged then: Unhealthy until the retry
                dirty.add(ns.name)
                continue
            path = str(self.dev_root / ns.name)
            try:
                fd = hold(path)
            except ScrubError as exc:
                self._failed(ns.name, exc)
                dirty.add(ns.name)
                continue
            if fd is None:  # in use by the job that wrote it: allocated to it, so no one else gets it
                held.add(ns.name)
                continue
            dirty.add(ns.name)
            if not start or self._stopping.is_set():
                os.close(fd)
                continue
            log.info("%s: %s; no process holds it any more: scrubbing it now, Unhealthy until done", path, reason)
            self._start(ns.name, path, fd)
        self.held = frozenset(held)
        return frozenset(dirty)

    def _start(self, name: str, path: str, fd: int) -> None:
        thread = threading.Thread(target=self._run, args=(name, path, fd), name=f"scrub-{name}", daemon=True)
        with self._lock:
            self._running[name] = thread
        thread.start()

    def _run(self, name: str, path: str, fd: int) -> None:
        started = time.monotonic()
        try:
            done = scrub_held(fd, path, stop=self._stopping.is_set, used=self.used(name), **self._where)
            if self.marks is not None:
                (self.marks / name).unlink(missing_ok=True)
            log.info("%s: %s; offering it again", path, done or "already scrubbed")
            if self.metrics is not None:
                self.metrics.scrubs.labels("clean").inc()
                self.metrics.scrub_seconds.observe(time.monotonic() - started)
            with self._lock:
                self._retry_at.pop(name, None)
        except (ScrubError, DeviceUnsafeError) as exc:
            self._failed(name, exc)
        except Exception as exc:  # a bug must not end the thread silently: the namespace stays Unhealthy
            log.exception("%s: scrub failed unexpectedly", path)
            self._failed(name, exc)
        finally:
            os.close(fd)
            with self._lock:
                del self._running[name]
            self._on_done()

    def _failed(self, name: str, exc: Exception) -> None:
        if self.metrics is not None:
            self.metrics.scrubs.labels("failed").inc()
        with self._lock:
            self._retry_at[name] = time.monotonic() + self._retry_s
        log.warning("%s; it stays Unhealthy, retrying in %.0f s", exc, self._retry_s)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask running scrubs to stop at their next chunk and wait for them; an unfinished one keeps its
        header not SCRUBBED, so the next agent scrubs it again from the start."""
        self._stopping.set()
        with self._lock:
            threads = list(self._running.values())
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
