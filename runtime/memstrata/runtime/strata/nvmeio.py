"""The raw-NVMe engine's I/O (memstrata.runtime.strata.nvme): reads and writes of extents over its devices.

A read or write of one extent becomes ops: O_DIRECT needs aligned memory and lengths, so an aligned buffer is used
in place up to its last whole block and the rest goes through a bounce region; each stripe's bytes go to their
device in ops of at most `max_io_bytes`. Completions are accounted per device and per handle (of a handle's
failed ops, the one reported is the one that starts first in the extent). Every wait is bounded by the I/O
queue's timeout (memstrata.runtime.strata.iobackend), and a wait that fails names the operation, the device and
what is in flight where.
"""
from __future__ import annotations

import errno as E
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memstrata.runtime import _native
from memstrata.runtime.strata.buffers import as_byte_view
from memstrata.runtime.strata.errors import NvmeError
from memstrata.runtime.strata.extents import ExtentAllocator, round_up, stripe_chunks
from memstrata.runtime.strata.iobackend import register_fixed
from memstrata.node.header import DATA_OFFSET, Header

_PAGE = _native.PAGE_SIZE


@dataclass(frozen=True)
class Extent:
    """Where one tensor's bytes live: a run on each device of `slots`."""

    nbytes: int
    padded: int  # nbytes rounded up to `align`; what is really transferred
    align: int
    stripe_bytes: int
    slots: tuple[int, ...]  # engine device indices
    bases: tuple[int, ...]  # absolute byte offset of this extent's run on each slot
    # A part (`part_of`): the allocated extent it lies in and where in it it starts; None and 0 otherwise.
    whole: Extent | None = None
    offset: int = 0

    @property
    def root(self) -> Extent:
        """The allocated extent: this one, or the one it is a part of."""
        return self.whole or self


def part_of(extent: Extent, offset: int, nbytes: int) -> Extent:
    """Bytes [offset, offset + nbytes) of `extent` as an extent of their own: a slice of a tensor read or written
    without the rest (memstrata.runtime.swap.sliced). `offset` must be a multiple of the block size; the part's
    ops are the whole extent's stripe units cut to its range. Pure."""
    root, start = extent.root, extent.offset + offset
    if nbytes <= 0 or offset < 0 or offset + nbytes > extent.nbytes:
        raise ValueError(f"part [{offset}, {offset + nbytes}) is outside the extent's {extent.nbytes} bytes")
    if start % extent.align:
        raise ValueError(f"part offset {offset} is not a multiple of the block size {extent.align}")
    return Extent(nbytes, round_up(nbytes, extent.align), extent.align, extent.stripe_bytes, extent.slots,
                  extent.bases, whole=root, offset=start)


@dataclass
class OpenedDevice:
    """A device the engine holds open: its allocator, its header and its I/O counters."""

    path: str
    fd: int
    lbs: int
    alloc: ExtentAllocator
    header: Header
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    fixed_ios: int = 0
    errors: int = 0
    # [DATA_OFFSET, dirty_end) may hold a job's data: zeroed on close. Only grows: freed extents keep their bytes.
    dirty_end: int = DATA_OFFSET


class Handle:
    """An asynchronous read or write of one extent; pass it to NvmeEngine.wait."""

    def __init__(self, kind: str, extent: Extent) -> None:
        self.kind = kind
        self.extent = extent
        self.pending = 0
        self.done = False
        self.error: NvmeError | None = None
        self._error_at = -1  # logical offset in the extent of the op whose failure `error` reports
        self._copy_back: tuple[memoryview, memoryview, int] | None = None
        self._keep: list[Any] = []  # bounce regions and views alive until completion


class ExtentIo:
    """The ops in flight over an engine's devices and its I/O queue, and the handles they complete."""

    def __init__(self, devices: list[OpenedDevice], queue: Any, *, max_io_bytes: int, backend: str) -> None:
        self._devices = devices
        self.queue = queue
        self.max_io_bytes = max_io_bytes
        self.backend = backend  # "io_uring" | "threads"
        self._tags = itertools.count(1)
        # tag -> (handle, slot, device offset, length, logical offset in the extent)
        self._inflight: dict[int, tuple[Handle, int, int, int, int]] = {}
        self._busy: dict[Extent, int] = {}

    def busy(self, extent: Extent) -> bool:
        """Whether `extent` (or a part of it) has I/O in flight."""
        return bool(self._busy.get(extent.root))

    def register(self, buffers: Sequence[Any]) -> bool:
        """Register long-lived host buffers as the queue's fixed buffers; False where the kernel refuses."""
        return register_fixed(self.queue, [as_byte_view(b, writable=True) for b in buffers],
                              device=self._devices[0].path)

    def close(self, timed_out: bool) -> None:
        """Tear the I/O queue down. After a wait that timed out, waiting the whole timeout again for the same ops
        is pointless: the queue gives them a second, then leaks (never frees) their buffers."""
        self.queue.close(timeout_s=min(1.0, self.queue.timeout_s) if timed_out else None)

    def wait(self, handle: Handle) -> None:
        """Block until `handle` completes; raise its NvmeError if it failed (or nothing completes for
        io_timeout_s: then errno ETIMEDOUT, and the handle stays in flight)."""
        while not handle.done:
            self._wait_queue(1, handle)
        if handle.error is not None:
            raise handle.error

    def wait_all(self) -> None:
        """Complete everything in flight (errors stay on their handles); NvmeError when the queue fails
        or nothing completes for io_timeout_s."""
        while self._inflight:
            self._wait_queue(-1, None)

    def poll(self) -> None:
        """Account completions that are ready, without blocking."""
        self._wait_queue(0, None)

    def _wait_queue(self, n: int, handle: Handle | None) -> None:
        if n != 0 and self.queue.queued == 0:
            # The ops this engine waits for are not in the queue: waiting would never end.
            raise self._wait_error(handle, f"{len(self._inflight)} ops in flight here, none in the I/O queue",
                                   E.EPROTO)
        try:
            results = self.queue.wait(n)
        except OSError as exc:
            raise self._wait_error(handle, exc.strerror or str(exc), exc.errno) from exc
        self._dispatch(results)

    def _wait_error(self, handle: Handle | None, why: str, errno: int | None) -> NvmeError:
        """What a failed wait reports: the operation, the device, and what is in flight where."""
        counts: dict[str, int] = {}
        for _, slot, _, _, _ in self._inflight.values():
            path = self._devices[slot].path
            counts[path] = counts.get(path, 0) + 1
        where = ", ".join(f"{n} on {path}" for path, n in counts.items()) or "none"
        if handle is not None:
            ext = handle.extent
            return NvmeError(f"{handle.kind} of {ext.nbytes} bytes did not complete: {why} "
                             f"[{self.backend}; ops in flight: {where}]", device=self._devices[ext.slots[0]].path,
                             offset=ext.bases[0], length=ext.padded, errno=errno)
        device = next(iter(counts), self._devices[0].path)
        return NvmeError(f"waiting for in-flight I/O failed: {why} [{self.backend}; ops in flight: {where}]",
                         device=device, errno=errno)

    def start(self, kind: str, extent: Extent, mv: memoryview) -> Handle:
        """Submit a `kind` ("read" or "write") of all of `extent` from or into `mv` (exactly extent.nbytes)."""
        handle = Handle(kind, extent)
        # O_DIRECT needs aligned memory and lengths: an aligned buffer is used in
        # place up to its last whole block; the rest goes through a bounce region.
        aligned = _native.buffer_address(mv)[0] % extent.align == 0
        prefix = extent.nbytes // extent.align * extent.align if aligned else 0
        bounce: memoryview | None = None
        if prefix < extent.padded:
            region = _native.Region(round_up(extent.padded - prefix, _PAGE))
            bounce = memoryview(region)
            handle._keep.append(region)
            if kind == "write":
                bounce[: extent.nbytes - prefix] = mv[prefix:]
            else:
                handle._copy_back = (bounce, mv, prefix)
        handle._keep.append(mv)
        self._busy[extent.root] = self._busy.get(extent.root, 0) + 1
        try:
            end = extent.offset + extent.padded
            for chunk in stripe_chunks(extent.root.padded, extent.stripe_bytes, len(extent.slots)):
                # In the part's own coordinates: a whole extent is a part at offset 0 of itself.
                lo, hi = max(chunk.logical, extent.offset), min(chunk.logical + chunk.length, end)
                if lo >= hi:
                    continue
                lo, hi = lo - extent.offset, hi - extent.offset
                slot = extent.slots[chunk.slot]
                dev_base = extent.bases[chunk.slot] + chunk.device_offset - chunk.logical + extent.offset
                if lo < prefix:
                    self._queue(handle, slot, mv, 0, lo, min(hi, prefix), dev_base)
                if hi > prefix and bounce is not None:
                    self._queue(handle, slot, bounce, prefix, max(lo, prefix), hi, dev_base)
        except OSError as exc:
            handle.error = NvmeError(f"{kind} submission failed", device=self._devices[extent.slots[0]].path,
                                     errno=exc.errno)
            if handle.pending == 0:
                self._finish(handle)
        return handle

    def _queue(self, handle: Handle, slot: int, src: memoryview, src_origin: int, lo: int, hi: int,
               dev_base: int) -> None:
        """Submit logical bytes [lo, hi) of `src` (which starts at logical `src_origin`)."""
        for start in range(lo, hi, self.max_io_bytes):
            n = min(self.max_io_bytes, hi - start)
            tag = next(self._tags)
            self._inflight[tag] = (handle, slot, dev_base + start, n, start)
            view = src[start - src_origin : start - src_origin + n]
            try:
                fixed = self.queue.submit(handle.kind == "write", slot, view, dev_base + start, tag)
            except BaseException:
                del self._inflight[tag]
                raise
            handle.pending += 1
            self._devices[slot].fixed_ios += bool(fixed)

    def _dispatch(self, results: list[tuple[int, int]]) -> None:
        for tag, res in results:
            handle, slot, offset, n, logical = self._inflight.pop(tag)
            dev = self._devices[slot]
            if res == n:
                if handle.kind == "write":
                    dev.bytes_written += n
                    dev.writes += 1
                else:
                    dev.bytes_read += n
                    dev.reads += 1
            else:
                dev.errors += 1
                # Ops of one handle complete in any order (the thread path's above all): the one
                # reported is the failing op that starts first in the extent, whatever the order.
                if handle.error is None or logical < handle._error_at:
                    reason = (f"{handle.kind} failed" if res < 0
                              else f"short {handle.kind}: {res} of {n} bytes (past the end of the device?)")
                    handle.error = NvmeError(reason, device=dev.path, offset=offset, length=n,
                                             errno=-res if res < 0 else E.EIO)
                    handle._error_at = logical
            handle.pending -= 1
            if handle.pending == 0:
                self._finish(handle)

    def _finish(self, handle: Handle) -> None:
        if handle._copy_back is not None and handle.error is None:
            bounce, mv, prefix = handle._copy_back
            mv[prefix:] = bounce[: mv.nbytes - prefix]
        handle._copy_back = None
        for obj in handle._keep:
            if isinstance(obj, memoryview):
                try:
                    obj.release()
                except BufferError:
                    pass  # a caller's own export of it is still alive; GC frees it later
        handle._keep.clear()
        root = handle.extent.root
        left = self._busy[root] - 1
        if left:
            self._busy[root] = left
        else:
            del self._busy[root]
        handle.done = True
