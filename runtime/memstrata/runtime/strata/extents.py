"""Extent allocation on one device, and the striping map over several. Pure.

Tensors on raw NVMe are addressed by extents (device, offset, length), not
files: no filesystem metadata, no page cache, no fragmentation we cannot see.
The allocator is best-fit over a sorted free list that coalesces on free, so
freeing everything always gives back one extent of the full capacity.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass


class ExtentError(ValueError):
    """An allocator request that cannot be honoured (the façade adds the device)."""

    def __init__(self, message: str, *, no_space: bool = False) -> None:
        self.no_space = no_space
        super().__init__(message)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class FreeStats:
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    largest_free_bytes: int
    free_extents: int
    allocated_extents: int

    @property
    def fragmentation(self) -> float:
        """0 when all free space is one extent, towards 1 as it splinters."""
        if self.free_bytes == 0:
            return 0.0
        return 1.0 - self.largest_free_bytes / self.free_bytes


class ExtentAllocator:
    """Allocates `align`-aligned byte ranges inside [start, start + capacity)."""

    def __init__(self, start: int, capacity: int, align: int) -> None:
        if align <= 0 or align & (align - 1):
            raise ExtentError(f"alignment must be a power of two, got {align}")
        if start % align or capacity % align or capacity <= 0:
            raise ExtentError(f"start {start} and capacity {capacity} must be positive multiples of {align}")
        self.start, self.capacity, self.align = start, capacity, align
        self._offsets: list[int] = [start]  # free extents, sorted by offset
        self._lengths: list[int] = [capacity]
        self._used: dict[int, int] = {}  # offset -> length of live allocations

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """(offset, length) of a fresh extent of at least `nbytes`, length rounded to `align`."""
        if nbytes <= 0:
            raise ExtentError(f"allocation size must be positive, got {nbytes}")
        need = round_up(nbytes, self.align)
        best = -1
        for i, length in enumerate(self._lengths):
            if length >= need and (best < 0 or length < self._lengths[best]):
                best = i
                if length == need:
                    break
        if best < 0:
            st = self.stats()
            raise ExtentError(
                f"out of space: need {need} bytes, {st.free_bytes} free, largest free extent "
                f"{st.largest_free_bytes}",
                no_space=True,
            )
        offset = self._offsets[best]
        if self._lengths[best] == need:
            del self._offsets[best], self._lengths[best]
        else:
            self._offsets[best] += need
            self._lengths[best] -= need
        self._used[offset] = need
        return offset, need

    def free(self, offset: int) -> None:
        """Return the extent starting at `offset`; merges with free neighbours."""
        length = self._used.pop(offset, None)
        if length is None:
            raise ExtentError(f"no live extent starts at offset {offset} (double free?)")
        i = bisect.bisect_left(self._offsets, offset)
        if i > 0 and self._offsets[i - 1] + self._lengths[i - 1] == offset:
            i -= 1
            self._lengths[i] += length
        else:
            self._offsets.insert(i, offset)
            self._lengths.insert(i, length)
        if i + 1 < len(self._offsets) and self._offsets[i] + self._lengths[i] == self._offsets[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            del self._offsets[i + 1]

    def stats(self) -> FreeStats:
        free = sum(self._lengths)
        return FreeStats(
            capacity_bytes=self.capacity,
            free_bytes=free,
            used_bytes=self.capacity - free,
            largest_free_bytes=max(self._lengths, default=0),
            free_extents=len(self._lengths),
            allocated_extents=len(self._used),
        )


@dataclass(frozen=True)
class Chunk:
    """One contiguous run of a striped extent on one device."""

    logical: int  # offset inside the tensor's bytes
    length: int
    slot: int  # index into the extent's device list
    device_offset: int  # offset relative to that device's base


def per_device_bytes(padded: int, stripe: int, ndev: int) -> list[int]:
    """Bytes each of `ndev` devices holds of a `padded`-byte striped extent."""
    sizes = [0] * ndev
    for c in stripe_chunks(padded, stripe, ndev):
        sizes[c.slot] += c.length
    return sizes


def stripe_chunks(padded: int, stripe: int, ndev: int) -> Iterator[Chunk]:
    """Round-robin stripe units: unit k goes to device k % ndev at (k // ndev) * stripe."""
    if ndev == 1:
        yield Chunk(0, padded, 0, 0)
        return
    for k, lo in enumerate(range(0, padded, stripe)):
        yield Chunk(lo, min(stripe, padded - lo), k % ndev, (k // ndev) * stripe)
