"""Tensors swapped to extents of the raw-NVMe engine, behind DeepSpeed's aio-handle interface.

DeepSpeed's swappers do every byte of I/O through an aio handle with
`async_pwrite(buffer, path, offset)`, `async_pread(...)` and `wait()`; the
path is only a name for the tensor. `ExtentSwapHandle` keeps that interface,
so DeepSpeed's swap bookkeeping is reused, but each name maps to an extent
on memstrata's NVMe stratum (striped over all of its namespaces) instead of a
file: nothing is written to DeepSpeed's swap folder. Host buffers it hands
out (`new_cpu_locked_tensor`) come from the rank's `LockedPool`
(memstrata.runtime.strata.pinned), carved exactly from locked regions rather
than pinned by torch (power-of-two rounding) or by the aio op (posix_memalign
per buffer).

Counters (bytes per direction, extents live, peak concurrency) feed the
runtime's status payload and the tests that prove no silent fallback.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memstrata.runtime.strata.buffers import as_byte_view
from memstrata.runtime.strata.nvme import NvmeEngine
from memstrata.runtime.strata.nvmeio import Extent, Handle, part_of
from memstrata.runtime.strata.pinned import LockedPool
from memstrata.runtime.swap.tokens import IoTokens

__all__ = ["SwapCounters", "ExtentSwapHandle", "SwapError"]


class SwapError(RuntimeError):
    """A swap request that cannot be served; the message names the tensor and why."""


@dataclass
class SwapCounters:
    """What moved through the NVMe stratum (one per rank)."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    extents_live: int = 0
    extent_bytes_live: int = 0
    extent_bytes_peak: int = 0  # the most state held on the stratum at once: its peak use
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [written, read]

    def add(self, kind: str, nbytes: int, write: bool) -> None:
        w_r = self.by_kind.setdefault(kind, [0, 0])
        if write:
            self.bytes_written += nbytes
            self.writes += 1
            w_r[0] += nbytes
        else:
            self.bytes_read += nbytes
            self.reads += 1
            w_r[1] += nbytes


# The longest a rank waits for the node's I/O token before doing its I/O without one: several sub-groups'
# transfer time at NVMe speed, short enough that a peer stuck in a collective costs seconds, not the run.
TOKEN_WAIT_S = 2.0


class ExtentSwapHandle:
    """DeepSpeed's aio-handle interface over extents of an NvmeEngine.

    One handle per swapper, like DeepSpeed's; all handles of a rank share one
    engine (single-threaded by design), one counter set and one I/O token."""

    def __init__(self, engine: NvmeEngine | None, pool: LockedPool, counters: SwapCounters, *, kind: str,
                 tokens: IoTokens | None = None, checksums: dict[str, str] | None = None,
                 lock: threading.Lock | None = None) -> None:
        self.engine = engine
        self.pool = pool
        self.counters = counters
        self.kind = kind
        self.tokens = tokens
        self.checksums = checksums  # name -> sha256 of what was last written (tests turn this on)
        names = getattr(engine, "_memstrata_names", None) if engine is not None else {}
        if names is None:
            names = engine._memstrata_names = {}  # type: ignore[union-attr]  # shared by the rank's handles
        self._extents: dict[str, Extent] = names
        self._pending: list[tuple[Handle, str, Any, bool]] = []
        self._token_held = False
        self._token_taken = False
        self.on_io: Callable[[str, float, float], None] | None = None  # (kind, start, end) for tests
        self._t0 = 0.0

    def discard(self, path: str) -> bool:
        """Give the extent stored under `path` back to the engine (a tensor that no longer exists)."""
        extent = self._extents.pop(path, None)
        if extent is None or self.engine is None:
            return False
        self.engine.free(extent)
        self.counters.extents_live -= 1
        self.counters.extent_bytes_live -= extent.padded
        return True

    # -- the interface DeepSpeed's swappers call -----------------------------------------------
    def _stratum(self, path: str) -> NvmeEngine:
        if self.engine is None:
            raise SwapError(f"{path}: the plan puts nothing on NVMe, so this run opened no namespace (no_nvme), "
                            f"but DeepSpeed asked to swap it; the {self.kind} swapper and the plan disagree")
        return self.engine

    def async_pwrite(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int:
        engine = self._stratum(path)
        if offset:
            raise SwapError(f"{path}: memstrata stores whole tensors; offset {offset} is not supported")
        nbytes = buffer.numel() * buffer.element_size()
        return self._write(engine, buffer, path, self.reserve(path, nbytes), None)

    def async_pread(self, buffer: torch.Tensor, path: str, offset: int = 0) -> int:
        engine = self._stratum(path)
        if offset:
            raise SwapError(f"{path}: memstrata stores whole tensors; offset {offset} is not supported")
        extent = self.extent_of(path)
        return self._read(engine, buffer, path, extent, None)

    # -- parts of a tensor (memstrata.runtime.swap.sliced) ----------------------------------------
    def reserve(self, path: str, nbytes: int) -> Extent:
        """The extent that holds the tensor named `path` of `nbytes` bytes, allocated if it has none yet."""
        engine = self._stratum(path)
        extent = self._extents.get(path)
        if extent is not None and extent.nbytes != nbytes:
            # DeepSpeed rewrites a name only with the same aligned size; anything else is a new tensor.
            self.discard(path)
            extent = None
        if extent is None:
            extent = engine.allocate(nbytes)
            self._extents[path] = extent
            self.counters.extents_live += 1
            self.counters.extent_bytes_live += extent.padded
            self.counters.extent_bytes_peak = max(self.counters.extent_bytes_peak,
                                                  self.counters.extent_bytes_live)
        return extent

    def write_part(self, buffer: torch.Tensor, path: str, offset: int) -> int:
        """Start writing `buffer` as bytes [offset, offset + its size) of the tensor `path`, `reserve`d before."""
        engine = self._stratum(path)
        nbytes = buffer.numel() * buffer.element_size()
        return self._write(engine, buffer, path, self._part(path, self.extent_of(path), offset, nbytes), offset)

    def read_part(self, buffer: torch.Tensor, path: str, offset: int) -> int:
        """Start reading bytes [offset, offset + `buffer`'s size) of the tensor `path` into `buffer` (the
        tensor's tail when less is left)."""
        engine = self._stratum(path)
        extent = self.extent_of(path)
        nbytes = min(buffer.numel() * buffer.element_size(), extent.nbytes - offset)
        return self._read(engine, buffer, path, self._part(path, extent, offset, nbytes), offset)

    def extent_of(self, path: str) -> Extent:
        """The extent the tensor named `path` is stored in."""
        extent = self._extents.get(path)
        if extent is None:
            raise SwapError(f"{path}: read of a tensor that was never written to the NVMe stratum")
        return extent

    @staticmethod
    def _part(path: str, extent: Extent, offset: int, nbytes: int) -> Extent:
        try:
            return part_of(extent, offset, nbytes)
        except ValueError as exc:
            raise SwapError(f"{path}: {exc}") from None

    def _write(self, engine: NvmeEngine, buffer: torch.Tensor, path: str, target: Extent, offset: int | None) -> int:
        src = buffer.detach().contiguous()
        self._begin()
        if self.checksums is not None:
            self._checksum(path, offset, target.nbytes, _digest(src))
        self._pending.append((engine.write(target, src), path, src, True))
        self.counters.add(self.kind, target.nbytes, write=True)
        return 0

    def _read(self, engine: NvmeEngine, buffer: torch.Tensor, path: str, target: Extent, offset: int | None) -> int:
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes < target.nbytes:
            raise SwapError(f"{path}: read buffer of {nbytes} bytes is smaller than the stored {target.nbytes}")
        if not buffer.is_contiguous():
            raise SwapError(f"{path}: read buffer is not contiguous")
        dst = buffer.view(-1).view(torch.uint8)[:target.nbytes]
        self._begin()
        self._pending.append((engine.read(target, dst), _key(path, offset, target.nbytes), dst, False))
        self.counters.add(self.kind, target.nbytes, write=False)
        return 0

    def _checksum(self, path: str, offset: int | None, nbytes: int, digest: str) -> None:
        """Record what was written under its key; a whole write makes the parts' digests stale, a part's write
        the whole's (and a same-offset part's)."""
        assert self.checksums is not None
        stale = ([k for k in self.checksums if k.startswith(f"{path}@")] if offset is None
                 else [path, *(k for k in self.checksums if k.startswith(f"{path}@{offset}+"))])
        for k in stale:
            self.checksums.pop(k, None)
        self.checksums[_key(path, offset, nbytes)] = digest

    def wait(self) -> int:
        """Complete every I/O this handle started; the count, as DeepSpeed asserts on it."""
        done, first = len(self._pending), None
        try:
            for handle, path, buf, write in self._pending:
                try:
                    self._stratum(path).wait(handle)
                except Exception as exc:  # keep draining: every buffer must be quiescent
                    first = first or exc
                    continue
                if not write and self.checksums is not None and path in self.checksums:
                    if _digest(buf) != self.checksums[path]:
                        first = first or SwapError(f"{path}: data read back differs from what was written")
        finally:
            self._pending.clear()
            self._end()
        if first is not None:
            raise first
        return done

    def new_cpu_locked_tensor(self, numel: int, example: torch.Tensor) -> torch.Tensor:
        return self.pool.tensor(int(numel), example.dtype)

    def free_cpu_locked_tensor(self, t: torch.Tensor) -> bool:
        self.pool.free(t)
        return True

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.pool.owns(t)

    # -- memstrata additions ---------------------------------------------------------------------
    def _begin(self) -> None:
        if not self._token_held:
            # Only the update's I/O takes the node's token (MLP-Offload's contention is there). A parameter's
            # swap-in is submitted before ZeRO-3's all-gather and waited after it: a rank holding the token
            # across that collective while its peer waits for the token would hang both, so parameter I/O never
            # takes one, and the update's wait is bounded all the same (a gradient swap-out may span a
            # reduce-scatter).
            self._token_taken = (self.tokens is not None and self.kind != "param"
                                 and self.tokens.acquire(timeout_s=TOKEN_WAIT_S))
            self._token_held = True
            self._t0 = time.monotonic()

    def _end(self) -> None:
        if self._token_held:
            t1 = time.monotonic()
            if self.on_io is not None:
                self.on_io(self.kind, self._t0, t1)
            if self._token_taken and self.tokens is not None:
                self.tokens.release()
            self._token_held = self._token_taken = False


def _key(path: str, offset: int | None, nbytes: int) -> str:
    """A whole tensor's checksum key is its name; a part's, the name with its byte range."""
    return path if offset is None else f"{path}@{offset}+{nbytes}"


def _digest(t: Any) -> str:
    return hashlib.sha256(as_byte_view(t, writable=False)).hexdigest()
