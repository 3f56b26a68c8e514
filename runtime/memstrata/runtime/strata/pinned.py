"""The locked-memory pool: exact-size page-locked host buffers for the swap layer.

DeepSpeed pins `buffer_count` buffers all sized for the largest tensor (or the
largest sub-group), and torch's pinned allocator rounds each request up to a
power of two. `LockedPool` hands out exactly what is asked (rounded to 4 KiB),
carved first-fit from locked regions that it adds `chunk_bytes` at a time only
when no free run fits, and gives idle regions back on `trim()`. Each region is
placed on its NUMA nodes (mbind before the first touch) and mlock'ed, so
`locked_bytes` is what the kernel counts (VmLck); a too-low RLIMIT_MEMLOCK is
reported with the number needed.

A pod cannot raise that limit itself: with every capability dropped (PodSecurity
`restricted`) it keeps the container runtime's RLIMIT_MEMLOCK, 8 MiB on current
kernels, and CAP_IPC_LOCK would not reach a non-root process anyway. With
`lock_fallback` the pool then warns once, with the same numbers, and goes on with
unlocked regions: O_DIRECT I/O pins each op's pages itself, so only the guarantee
that the buffers stay resident is lost, never correctness.

On a GPU a pool is given its `DmaDevice` (memstrata.runtime.strata.dma): each
region is registered with the device, so copies to and from it are the GPU's own
asynchronous DMA, and a freed buffer is reused only once the copies queued on it
have run (`free` takes a fence; until it passes the bytes still count as in use).

This is the only locked-memory allocator of the runtime: memstrata.runtime.swap
builds one per kind of buffer and rank (optimizer operands on DRAM, parameter
staging over CXL, activation checkpoints, the host buffers DeepSpeed pins) and
DeepSpeed's swappers receive their buffers from them.
"""
from __future__ import annotations

import errno as E
import logging
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memstrata.runtime import _native
from memstrata.runtime.strata.affinity import Placement
from memstrata.runtime.strata.buffers import is_torch_tensor, torch_module
from memstrata.runtime.strata.dma import DmaDevice, Fence
from memstrata.runtime.strata.errors import NumaError, PinnedMemoryError
from memstrata.runtime.strata.extents import ExtentAllocator, ExtentError

__all__ = ["ALIGN", "LockedPool", "PinnedMemoryError", "vm_locked_bytes"]

ALIGN = 4096
# What mlock answers when the limit, not the memory, is short: over RLIMIT_MEMLOCK (ENOMEM),
# a limit of 0 without CAP_IPC_LOCK (EPERM), some pages not lockable (EAGAIN).
_LIMIT_ERRNOS = (E.ENOMEM, E.EPERM, E.EAGAIN)

log = logging.getLogger(__name__)
_warned = False  # one warning per process: every pool of every rank meets the same limit


def vm_locked_bytes(pid: str = "self") -> int:
    """VmLck of a process: what the kernel counts against RLIMIT_MEMLOCK."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    return 0


def _lock_error(size: int, exc: OSError) -> PinnedMemoryError:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else soft
    already = vm_locked_bytes()
    needed = already + size
    if limit is not None and needed > limit:
        msg = (f"cannot lock {size} bytes of the locked pool: RLIMIT_MEMLOCK is {limit} bytes and {already} are "
               f"already locked; it must be at least {needed} bytes (ulimit -l {-(-needed // 1024)}, or "
               f"CAP_IPC_LOCK; or set the swap layer's lock_memory off)")
    else:
        msg = f"cannot lock {size} bytes of the locked pool: {exc.strerror}"
    return PinnedMemoryError(msg, needed_bytes=needed, limit_bytes=limit, errno=exc.errno)


class LockedPool:
    """Exact-size page-locked host buffers, carved from locked regions of `chunk_bytes`.

    A request gets exactly its size rounded to 4 KiB (no power-of-two rounding,
    no buffer sized for the largest tensor); freed space is reused first-fit,
    and a region is only added when no free run fits. Constructing a pool
    allocates nothing."""

    def __init__(self, chunk_bytes: int = 64 << 20, lock: bool = True, placement: Placement | None = None,
                 lock_fallback: bool = False, dma: DmaDevice | None = None) -> None:
        if chunk_bytes < ALIGN:
            raise ValueError(f"chunk_bytes must be at least {ALIGN}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.lock = lock
        self.lock_fallback = lock_fallback  # an mlock refused by the limit: warn, go on unlocked
        # The GPU that copies these buffers (None: the CPU). Its regions are registered with it, so copies to and
        # from the GPU are true asynchronous DMA, and frees are fenced by its events (memstrata.runtime.strata.dma).
        self.dma = dma
        self.registrations = 0  # regions registered with `dma`, all time
        self._fenced: list[tuple[Fence, int]] = []  # freed buffers (by address) whose copies may still run
        self._fencing: set[int] = set()  # their addresses
        self.unlocked_reason: str | None = None  # set when that happened
        self.placement = placement
        self._regions: dict[int, tuple[Any, ExtentAllocator]] = {}  # id -> region; ids are never reused
        self._region_use: dict[int, int] = {}  # id -> bytes handed out
        self._next_region = 0
        self._kept: set[int] = set()  # regions `reserve` made: never released before close
        self._owner: dict[int, tuple[int, int, int]] = {}  # address -> (region id, offset, bytes)
        self.locked_bytes = 0  # bytes of the regions held now (mlock'ed unless `lock` is off)
        self.peak_in_use = 0
        self._in_use = 0
        self.released_bytes = 0  # given back in all, by trim() and before growing

    # -- buffers -------------------------------------------------------------------------------------
    @property
    def in_use(self) -> int:
        """Bytes handed out, including freed buffers whose copies have not run yet."""
        self.reap()
        return self._in_use

    def take(self, nbytes: int) -> memoryview:
        """A writable view of exactly `nbytes` locked bytes (at least one), 4 KiB aligned."""
        nbytes = max(1, nbytes)
        self.reap()
        found = self._carve(nbytes)
        if found is None and self._fenced:
            # The space freed with copies still in flight is reused once they have run, before locking more.
            self._drain()
            found = self._carve(nbytes)
        if found is not None:
            return self._hand_out(*found, nbytes)
        idx, region, alloc = self._grow(nbytes)
        off, size = alloc.allocate(nbytes)
        return self._hand_out(idx, region, off, size, nbytes)

    def _carve(self, nbytes: int) -> tuple[int, Any, int, int] | None:
        for idx, (region, alloc) in self._regions.items():
            try:
                off, size = alloc.allocate(nbytes)
            except ExtentError:
                continue
            return idx, region, off, size
        return None

    def tensor(self, numel: int, dtype: Any) -> Any:
        """A 1-D torch tensor of `numel` elements of `dtype` over locked bytes (no copy); `numel` may be 0."""
        torch = torch_module()
        view = self.take(max(1, numel) * dtype.itemsize)
        # torch.frombuffer, never torch.empty: while a model is built zero.Init makes every new tensor on the
        # accelerator and casts floating ones to its dtype. And a tensor of its own over the buffer, not a view of
        # another: a view keeps its base (and so the storage) alive even after `.data` is pointed elsewhere, as
        # ZeRO-3 does with the partitions it moves into a flat buffer.
        t = torch.frombuffer(view, dtype=dtype, count=max(1, numel))
        return t if numel else t.set_(t.untyped_storage(), 0, (0,))

    def owns(self, buffer: Any) -> bool:
        """Whether `buffer` (a tensor or buffer) lies in one of this pool's regions."""
        ptr = _address(buffer)
        return any(region.address <= ptr < region.address + region.size for region, _ in self._regions.values())

    def free(self, buffer: Any, *, streams: tuple[Any, ...] = ()) -> None:
        """Give back a buffer from take() or tensor() (or its address, once no tensor of it is left); raises
        ValueError for a foreign or freed one.

        With a DMA device the space is reused only after the copies queued on the buffer so far, on the
        current stream and on `streams` (where the caller queued its copies), have run."""
        key = _address(buffer)
        if key not in self._owner or key in self._fencing:
            raise ValueError("buffer was not handed out by this pool (or was freed twice)")
        if self.dma is not None:
            self._fenced.append((self.dma.fence(streams), key))
            self._fencing.add(key)
            return
        self._give_back(key)

    def reap(self) -> int:
        """Give back the freed buffers whose copies have run; how many."""
        if not self._fenced:
            return 0
        keep: list[tuple[Fence, int]] = []
        done: list[tuple[Fence, int]] = []
        for entry in self._fenced:
            (done if entry[0].done() else keep).append(entry)
        self._fenced = keep
        for _, key in done:
            self._fencing.discard(key)
            self._give_back(key)
        return len(done)

    def _drain(self) -> None:
        """Wait for every fenced free, then give them back."""
        for fence, _ in self._fenced:
            fence.wait()
        self.reap()

    def _give_back(self, key: int) -> None:
        idx, off, size = self._owner.pop(key)
        self._regions[idx][1].free(off)
        self._region_use[idx] -= size
        self._in_use -= size

    # -- regions -------------------------------------------------------------------------------------
    def _grow(self, nbytes: int, exact: bool = False) -> tuple[int, Any, ExtentAllocator]:
        size = -(-nbytes // ALIGN) * ALIGN if exact else max(self.chunk_bytes, -(-nbytes // ALIGN) * ALIGN)
        # An idle region made for one large buffer (larger than a chunk) is kept only for a later request
        # that fits in it; this one did not, so give such regions back before locking more. Otherwise
        # sub-groups of slightly different sizes each leave one behind, and the update locks every one of
        # them until trim(). Idle chunks stay: the many small buffers reuse them.
        self._release(lambda idx, region: region.size > self.chunk_bytes)
        try:
            region = _native.Region(size)
        except OSError as exc:
            raise PinnedMemoryError(f"cannot map {size} bytes for the locked pool: {exc.strerror}",
                                    needed_bytes=size, limit_bytes=None, errno=exc.errno) from None
        placement = self.placement
        if placement is not None and placement.nodes:
            # mbind before the first touch (mlock faults every page in), so pages land where placement says.
            try:
                region.bind(list(placement.nodes), int(placement.policy))
            except OSError as exc:
                region.close()
                nodes = ",".join(map(str, placement.nodes))
                raise NumaError(f"cannot place {size} bytes of the locked pool with policy "
                                f"{placement.policy.name.lower()} on NUMA nodes {nodes}: {exc.strerror}",
                                nodes=placement.nodes, errno=exc.errno) from None
        if self.lock:
            try:
                region.lock()
            except OSError as exc:
                error = _lock_error(size, exc)
                if not (self.lock_fallback and exc.errno in _LIMIT_ERRNOS):
                    region.close()
                    raise error from None
                self._go_unlocked(str(error))
        if self.dma is not None:
            try:
                self.dma.register(region.address, size)
            except BaseException:
                region.close()
                raise
            self.registrations += 1
        alloc = ExtentAllocator(0, size, ALIGN)
        idx, self._next_region = self._next_region, self._next_region + 1
        self._regions[idx], self._region_use[idx] = (region, alloc), 0
        self.locked_bytes += size
        return idx, region, alloc

    def _go_unlocked(self, why: str) -> None:
        """Stop locking (this region and every later one): the limit will not grow while the process runs."""
        global _warned
        self.lock = False
        self.unlocked_reason = why
        if not _warned:
            _warned = True
            log.warning("memstrata: %s; going on with unlocked host buffers (correct, but the kernel may page "
                        "them out)", why)

    def _hand_out(self, idx: int, region: Any, off: int, size: int, nbytes: int) -> memoryview:
        view = memoryview(region)[off : off + nbytes]
        self._owner[region.address + off] = (idx, off, size)
        self._region_use[idx] += size
        self._in_use += size
        self.peak_in_use = max(self.peak_in_use, self._in_use)
        return view

    def node_of_pages(self, buffer: Any) -> list[int]:
        """The NUMA node of every page of a buffer handed out by this pool (move_pages)."""
        ptr = _address(buffer)
        if ptr not in self._owner:
            raise ValueError("buffer was not handed out by this pool (or was freed)")
        idx, off, size = self._owner[ptr]
        return list(self._regions[idx][0].node_of_pages(off, size))

    def reserve(self, nbytes: int) -> int:
        """Lock `nbytes` (page-rounded) now, in one region kept for the pool's life: neither `trim` nor growth
        gives it back. For buffers taken and returned every step (the optimizer update's), sized once by the rule
        that counts them, so they are carved from one mapping instead of chunks that leave a tail each. The bytes
        locked."""
        size = -(-max(0, nbytes) // ALIGN) * ALIGN
        if not size:
            return 0
        idx, _, _ = self._grow(size, exact=True)
        self._kept.add(idx)
        return size

    def trim(self) -> int:
        """Give back every region with nothing handed out; the bytes released.

        Called between phases (after the update): the update's working set and
        the activations of forward/backward then never count together in the
        peak. A region unmaps (and unlocks) once its last view is gone."""
        self.reap()
        return self._release(lambda idx, region: True)

    def _release(self, which: Callable[[int, Any], bool]) -> int:
        """Drop the idle regions `which` selects; the bytes released."""
        released = 0
        for idx in [i for i, used in self._region_use.items()
                    if used == 0 and i not in self._kept and which(i, self._regions[i][0])]:
            region, _ = self._regions.pop(idx)
            del self._region_use[idx]
            if self.dma is not None:
                self.dma.unregister(region.address)
            released += region.size
        self.locked_bytes -= released
        self.released_bytes += released
        return released

    def close(self) -> None:
        """Drop every region, after the copies still queued on freed buffers have run (a registered region is
        never unregistered under a running copy). Buffers still handed out must not be used afterwards."""
        if self.dma is not None:
            self._drain()
            for region, _ in self._regions.values():
                self.dma.unregister(region.address)
        self._fenced.clear()
        self._fencing.clear()
        self._owner.clear()
        self._regions.clear()  # regions unmap (and unlock) when their last view is gone
        self._region_use.clear()
        self.locked_bytes = 0


def _address(buffer: Any) -> int:
    """Where a buffer handed out by a pool starts (an int is that address already). A tensor is keyed by its
    storage, not its data pointer: a zero-element tensor's data pointer reads 0 wherever it lies, and a view's may
    start inside the buffer."""
    if isinstance(buffer, int):
        return buffer
    if is_torch_tensor(buffer):
        return int(buffer.untyped_storage().data_ptr())
    if hasattr(buffer, "data_ptr"):
        return int(buffer.data_ptr())
    return int(_native.buffer_address(buffer)[0])
