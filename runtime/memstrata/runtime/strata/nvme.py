"""Raw-NVMe engine: O_DIRECT io_uring I/O on extents of one or more devices.

Where the kernel refuses io_uring (a pod's RuntimeDefault seccomp profile, kernel.io_uring_disabled),
the same I/O goes through pread/pwrite worker threads with one warning naming the cause
(memstrata.runtime.strata.iobackend; MEMSTRATA_IO_BACKEND forces either path).

One engine owns a set of devices (raw namespaces, loop devices, or regular
files where no spare namespace exists). Opening a device checks it is safe
(memstrata.node.safety), takes it exclusively (O_EXCL for block devices,
flock for all), and stamps memstrata's header; a header left OPEN by a run
that was killed is simply superseded, and the allocator starts empty, so
`kill -9` mid-write never leaks space. Closing cleanly zeroes every byte the
engine may have written and only then stamps the header SCRUBBED
(claim.release_device), so the next job reads zeros; a killed run's OPEN
header tells the node agent to scrub the namespace before offering it again.
Tensors larger than one stripe are striped round-robin over the engine's
devices (multi-path).

Every wait is bounded: when the kernel completes nothing for `io_timeout_s`
(default 60 s), wait/wait_all fail with an NvmeError (errno ETIMEDOUT) naming
the device, the operation and what is in flight, instead of hanging the
process; close then gives up on those ops without freeing their buffers and
leaves the headers OPEN, so the node agent scrubs the devices.

The I/O itself (the ops of a transfer, bounce regions, completions, bounded
waits) is memstrata.runtime.strata.nvmeio's; this module opens, allocates,
counts and closes.

Single-threaded by design: one engine per rank, driven by its swap layer.
"""
from __future__ import annotations

import errno as E
import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from memstrata.runtime.strata.buffers import as_byte_view
from memstrata.runtime.strata.claim import claim_device, open_device, release_device
from memstrata.runtime.strata.errors import NvmeError
from memstrata.runtime.strata.extents import ExtentAllocator, ExtentError, FreeStats, per_device_bytes, round_up
from memstrata.runtime.strata.iobackend import OpenedQueue, choose_backend, open_queue
from memstrata.runtime.strata.nvmeio import Extent, ExtentIo, Handle, OpenedDevice
from memstrata.node.header import DATA_OFFSET, Header

__all__ = ["NvmeEngine", "NvmeError", "DeviceStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceStats:
    path: str
    logical_block_size: int
    space: FreeStats
    bytes_read: int
    bytes_written: int
    reads: int
    writes: int
    fixed_buffer_ios: int
    errors: int


class NvmeEngine:
    """Extents, asynchronous I/O and statistics over a set of opened devices."""

    def __init__(self, devices: list[OpenedDevice], ring: Any, *, stripe_bytes: int, max_io_bytes: int,
                 recovered: list[tuple[str, Header]], io_backend: str = "io_uring",
                 io_fallback: str | None = None) -> None:
        self._devices = devices
        self._io = ExtentIo(devices, ring, max_io_bytes=max_io_bytes, backend=io_backend)
        self.io_backend = io_backend  # "io_uring" | "threads"
        self.io_fallback = io_fallback  # why io_uring is not used, when the kernel refused it
        self.stripe_bytes = stripe_bytes
        self.max_io_bytes = max_io_bytes
        self.recovered = recovered  # stale headers of killed runs that open() reset
        self._live: set[Extent] = set()
        self._closed = False

    @classmethod
    def open(cls, paths: Sequence[str], *, job: str, queue_depth: int = 32, stripe_bytes: int = 1 << 20,
             max_io_bytes: int = 1 << 20, force: bool = False, busy_timeout_s: float = 5.0,
             io_backend: str | None = None, io_timeout_s: float = 60.0) -> NvmeEngine:
        """Open `paths` for job `job`; `force` overrides only the signature check.

        `io_backend`: auto | io_uring | threads (default: $MEMSTRATA_IO_BACKEND, else auto).
        `io_timeout_s`: how long a wait may go without any completion before it fails."""
        if not paths:
            raise ValueError("NvmeEngine.open needs at least one device path")
        choose_backend(io_backend)  # a misspelt backend fails before any device is claimed
        if not 0 < io_timeout_s <= 86400:
            raise ValueError(f"io_timeout_s={io_timeout_s} must be in (0, 86400] seconds")
        if len(set(map(os.path.realpath, paths))) != len(paths):
            raise ValueError(f"device list names the same device twice: {list(paths)}")
        set_id = uuid.uuid4()
        devices: list[OpenedDevice] = []
        recovered: list[tuple[str, Header]] = []
        try:
            for i, path in enumerate(paths):
                fd, lbs, size = open_device(path, force, busy_timeout_s)
                try:
                    header, stale, dirty_end = claim_device(path, fd, lbs, size, job, set_id, i, len(paths))
                except BaseException:
                    os.close(fd)
                    raise
                devices.append(OpenedDevice(path, fd, lbs, ExtentAllocator(DATA_OFFSET, header.capacity_bytes, lbs),
                                            header, dirty_end=dirty_end))
                if stale is not None:
                    recovered.append((path, stale))
            align = max(d.lbs for d in devices)
            for name, value in (("stripe_bytes", stripe_bytes), ("max_io_bytes", max_io_bytes)):
                if value <= 0 or value % align:
                    raise ValueError(f"{name}={value} must be a positive multiple of the block size {align}")
            opened: OpenedQueue = open_queue(queue_depth, [d.fd for d in devices], device=paths[0],
                                             backend=io_backend, timeout_s=io_timeout_s)
        except BaseException:
            for d in devices:
                os.close(d.fd)
            raise
        return cls(devices, opened.queue, stripe_bytes=stripe_bytes, max_io_bytes=max_io_bytes, recovered=recovered,
                   io_backend=opened.backend, io_fallback=opened.fallback)

    # -- extents -------------------------------------------------------------------------------
    def allocate(self, nbytes: int, *, devices: Iterable[int] | None = None) -> Extent:
        """An extent for `nbytes`, striped over `devices` (default: all). All or nothing."""
        self._check_open()
        slots = tuple(range(len(self._devices))) if devices is None else tuple(devices)
        if not slots or any(not 0 <= s < len(self._devices) for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"devices {slots} must be distinct indices below {len(self._devices)}")
        align = max(self._devices[s].lbs for s in slots)
        padded = round_up(nbytes, align) if nbytes > 0 else 0
        if padded == 0:
            raise ValueError(f"extent size must be positive, got {nbytes}")
        # A tensor smaller than the stripe set touches only the first devices.
        slots = slots[: -(-padded // self.stripe_bytes)]
        sizes = per_device_bytes(padded, self.stripe_bytes, len(slots))
        bases: list[int] = []
        try:
            for slot, size in zip(slots, sizes):
                dev = self._devices[slot]
                try:
                    base, length = dev.alloc.allocate(size)
                    bases.append(base)
                    dev.dirty_end = max(dev.dirty_end, base + length)
                except ExtentError as exc:
                    raise NvmeError(str(exc), device=dev.path, length=size,
                                    errno=E.ENOSPC if exc.no_space else E.EINVAL) from None
        except NvmeError:
            for slot, base in zip(slots, bases):
                self._devices[slot].alloc.free(base)
            raise
        extent = Extent(nbytes, padded, align, self.stripe_bytes, slots, tuple(bases))
        self._live.add(extent)
        return extent

    def free(self, extent: Extent) -> None:
        self._check_open()
        if extent not in self._live:
            raise ValueError("extent is not live in this engine (freed twice, or from another engine)")
        if self._io.busy(extent):
            raise ValueError("extent still has I/O in flight; wait for its handles first")
        self._live.discard(extent)
        for slot, base in zip(extent.slots, extent.bases):
            self._devices[slot].alloc.free(base)

    # -- I/O -----------------------------------------------------------------------------------
    def register_buffers(self, buffers: Sequence[Any]) -> bool:
        """Register long-lived host buffers (arenas) as io_uring fixed buffers.

        I/O whose memory lies inside one of them skips the per-op page pinning. Where the kernel
        refuses (RLIMIT_MEMLOCK in a pod), one warning and I/O goes on without; False then."""
        self._check_open()
        return self._io.register(buffers)

    def write(self, extent: Extent, data: Any) -> Handle:
        """Start writing `data` (exactly extent.nbytes) to `extent`."""
        return self._start("write", extent, as_byte_view(data, writable=False, what="write source"))

    def read(self, extent: Extent, out: Any) -> Handle:
        """Start reading `extent` into `out` (exactly extent.nbytes, writable)."""
        return self._start("read", extent, as_byte_view(out, writable=True, what="read destination"))

    def wait(self, handle: Handle) -> None:
        """Block until `handle` completes; raise its NvmeError if it failed (or nothing completes for
        io_timeout_s: then errno ETIMEDOUT, and the handle stays in flight)."""
        self._io.wait(handle)

    def wait_all(self) -> None:
        """Complete everything in flight (errors stay on their handles); NvmeError when the queue fails
        or nothing completes for io_timeout_s."""
        self._io.wait_all()

    def poll(self) -> None:
        """Account completions that are ready, without blocking."""
        self._io.poll()

    def _start(self, kind: str, extent: Extent, mv: memoryview) -> Handle:
        self._check_open()
        if extent.root not in self._live:
            raise ValueError("extent is not live in this engine")
        if mv.nbytes != extent.nbytes:
            raise ValueError(f"{kind} buffer has {mv.nbytes} bytes, extent holds {extent.nbytes}")
        return self._io.start(kind, extent, mv)

    # -- state ---------------------------------------------------------------------------------
    @property
    def paths(self) -> list[str]:
        return [d.path for d in self._devices]

    def stats(self) -> list[DeviceStats]:
        return [DeviceStats(d.path, d.lbs, d.alloc.stats(), d.bytes_read, d.bytes_written, d.reads, d.writes,
                            d.fixed_ios, d.errors) for d in self._devices]

    def close(self) -> None:
        """Finish in-flight I/O, zero what this engine wrote and mark every header SCRUBBED, release the devices.

        Where in-flight I/O could not be finished, or zeroing fails, the header stays OPEN: nothing may
        land after the zeros, and the node agent scrubs an OPEN namespace before anyone else gets it."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        try:
            self.wait_all()
        except BaseException as exc:  # the ring must still be torn down
            first = exc
        try:
            self._io.close(timed_out=isinstance(first, NvmeError) and first.errno == E.ETIMEDOUT)
        except OSError as exc:
            first = first or NvmeError(f"closing the I/O queue: {exc.strerror or exc}", device=self._devices[0].path,
                                       errno=exc.errno)
        drained = first is None
        for d in self._devices:
            try:
                if drained:
                    log.info("%s: %s", d.path, release_device(d.path, d.fd, d.header, d.lbs, d.dirty_end))
            except (NvmeError, OSError) as exc:
                first = first or exc
            finally:
                os.close(d.fd)
        if first is not None:
            raise first

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("NvmeEngine is closed")

    def __enter__(self) -> NvmeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
