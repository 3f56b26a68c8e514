"""The optimizer update pipelined: the next sub-groups read during Adam, the last one written behind it.

ZeRO-3's step loop (DeepSpeed 0.19.8) runs, per sub-group, swap-in (read,
wait), Adam, swap-out (write, wait): the NVMe stratum and the CPU take turns.
With `SwapSettings.prefetch_subgroups` = d > 0 and the walk of this step known
(memstrata.runtime.swap.suborder hands it over with `begin`):

- at the swap-in of the sub-group at position p, the state reads of the next
  d sub-groups that are on NVMe are submitted, each on a handle of its own, so
  Adam on p runs while they transfer, and waiting for one never waits for another;
- at the swap-out of p its writes are submitted on the write-back handle and
  the call returns; they are waited (and their buffers freed) at the next
  swap-out, and at the end of the loop (`finish`), so the state is durable when
  `step()` returns and no I/O token is held through the collectives after the
  loop.

Sub-groups whose state is in the DRAM cache are not read, non-swappable ones
are never in the walk, and gradients are not read ahead: they become final
only when their sub-group is current, and the swapper widens them then. Every
buffer read ahead is freed on every path: consumed by the swap-in, or dropped
by `finish` (a step skipped on overflow, an exception, a checkpoint path).
Outside a walk nothing is pipelined: stock's synchronous path runs.

The handles take the rank's one I/O token; IoTokens counts nested holds of a
rank, so the read-ahead and the write-back never wait for each other's token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from deepspeed.runtime.swap_tensor.utils import swap_in_tensors, swap_out_tensors

from memstrata.runtime.swap.handle import ExtentSwapHandle
from memstrata.runtime.swap.protocols import SwapInfo

if TYPE_CHECKING:
    from memstrata.runtime.swap.layer import SwapLayer

__all__ = ["ReadAhead", "StateSwapper"]


class _Buffers(Protocol):
    def allocate(self, num_elems: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]: ...

    def free(self, buffers: list[torch.Tensor]) -> None: ...


class StateSwapper(Protocol):
    """What the pipeline uses of memstrata's optimizer swapper (memstrata.runtime.swap.optimizer), which makes it:
    typed here, so that the pipeline does not import its maker back."""

    layer: SwapLayer
    swap_buffer_manager: _Buffers
    dtype: torch.dtype
    aio_handle: Any
    _cached: dict[str, list[torch.Tensor]]

    def _get_param_swap_info(self, parameter: torch.Tensor) -> SwapInfo | None: ...

    def _io_aligned_numel(self, numel: int) -> int: ...

    def _swap_out_unpinned_tensors(self, aio_handle: Any, unpinned_tensors: list[torch.Tensor],
                                   dest_paths: list[str], pinned_buffers: list[torch.Tensor]) -> None: ...


class _Record(SwapInfo, Protocol):
    """The two more methods of OptimizerStateSwapInfo the pipeline calls (declared in the seam)."""

    def get_swap_paths(self) -> list[str]: ...
    def get_swap_buffers_and_paths(self, pinned: bool) -> tuple[list[torch.Tensor], list[str]]: ...


@dataclass
class _Read:
    handle: ExtentSwapHandle
    buffers: list[torch.Tensor]  # one per state tensor, exact aligned size, in the record's order
    count: int  # the sub-group's num_tensors() when it was submitted


class ReadAhead:
    """One swapper's pipeline: `depth` reads ahead of the current sub-group, one write-back behind it."""

    def __init__(self, swapper: StateSwapper, depth: int) -> None:
        self.swapper, self.depth = swapper, depth
        layer = swapper.layer
        # depth + 1 read handles: the current sub-group's read is still waited on its handle while the
        # top-up submits the read `depth` positions ahead.
        self._idle = [layer.handle("optimizer") for _ in range(depth + 1)] if depth else []
        self._writer = layer.handle("optimizer") if depth else None
        self._reads: dict[str, _Read] = {}  # param id -> its read in flight
        self._writing: list[torch.Tensor] = []  # buffers of the write in flight, freed when it is waited
        self._walk: list[torch.Tensor] = []  # this step's swappable fp32 sub-groups, in update order
        self._position: dict[str, int] = {}
        # Sub-groups updated a slice at a time (memstrata.runtime.swap.sliced), which read their own slices:
        # never read ahead whole.
        self.never_read: set[str] = set()

    def begin(self, walk: list[torch.Tensor]) -> None:
        """This step's swappable fp32 sub-groups in the order the loop updates them."""
        self.finish()
        if self.depth:
            self._walk = list(walk)
            self._position = {self._pid(p): i for i, p in enumerate(self._walk)}

    def take(self, parameter: torch.Tensor, info: SwapInfo) -> list[torch.Tensor] | None:
        """At the swap-in of `parameter`: top up the reads ahead, then this sub-group's state buffers, read;
        None when it was not read ahead (the caller reads it, while the top-up's reads run)."""
        read = self._reads.pop(info.param_id, None)
        self.top_up(parameter)
        if read is None:
            return None
        try:
            read.handle.wait()
        except BaseException:
            self.swapper.swap_buffer_manager.free(read.buffers)
            raise
        finally:
            self._idle.append(read.handle)
        if read.count != info.num_tensors():  # its record changed since: read it again, as stock would
            self.swapper.swap_buffer_manager.free(read.buffers)
            return None
        self.swapper.layer.prefetch_hits += 1
        return read.buffers

    def top_up(self, parameter: torch.Tensor) -> None:
        """Submit the reads of the next `depth` sub-groups after `parameter` in the walk that are on NVMe."""
        at = self._position.get(self._pid(parameter)) if self._walk else None
        if at is None:
            return
        sw = self.swapper
        for ahead in self._walk[at + 1: at + 1 + self.depth]:
            info: SwapInfo | None = sw._get_param_swap_info(ahead)
            if info is None or info.param_id in self._reads or info.param_id in self.never_read or not self._idle:
                continue
            cached = sw._cached.get(info.param_id)
            if cached is not None and len(cached) == info.num_tensors():
                continue  # served from DRAM: nothing to read
            aligned = sw._io_aligned_numel(info.numel())
            buffers = sw.swap_buffer_manager.allocate(aligned, info.num_tensors(), sw.dtype)
            handle = self._idle.pop()
            try:
                swap_in_tensors(handle, buffers, cast(_Record, info).get_swap_paths())
            except BaseException:
                self._drain(handle)
                self._idle.append(handle)
                sw.swap_buffer_manager.free(buffers)
                raise
            self._reads[info.param_id] = _Read(handle, buffers, info.num_tensors())

    def write_back(self, info: SwapInfo) -> bool:
        """Inside a walk: submit `info`'s state writes and release its record, the buffers freed once they
        are written (at the next write-back or `finish`). False outside a walk: the caller writes in place."""
        if not self._walk or self._writer is None:
            return False
        sw = self.swapper
        self._wait_write()
        n = info.num_tensors()
        record = cast(_Record, info)
        tensors, paths = record.get_swap_buffers_and_paths(True)
        written, extra = info.swap_buffers[:n], info.swap_buffers[n:]
        try:
            swap_out_tensors(self._writer, tensors, paths)
        except BaseException:
            self._drain(self._writer)  # the buffers stay with the record, as after a failed stock write
            raise
        self._writing = written
        unpinned, unpinned_paths = record.get_swap_buffers_and_paths(False)
        if unpinned:  # the first step's moments are ordinary tensors: staged through exact buffers, in place
            # Sized for this sub-group, not the largest of all (a resident one may be far larger), and freed
            # even when the write fails.
            staging = sw.swap_buffer_manager.allocate(sw._io_aligned_numel(info.numel()), 2, sw.dtype)
            try:
                sw._swap_out_unpinned_tensors(aio_handle=sw.aio_handle, unpinned_tensors=unpinned,
                                              dest_paths=unpinned_paths, pinned_buffers=staging)
            except BaseException:
                sw.swap_buffer_manager.free(staging)
                raise
            extra = extra + staging
        info.swap_buffers = []
        info.release_memory()
        sw.swap_buffer_manager.free(extra)  # the gradient buffer and staging: nothing in flight reads them
        info.release_unswapped_gradients()
        return True

    def settle(self) -> None:
        """Wait the write-back in flight, if any, and free its buffers (before a sliced update takes its own)."""
        self._wait_write()

    def finish(self) -> None:
        """End of the walk: wait the write-back, drop every read ahead that no swap-in took (buffers freed),
        then raise the first I/O error, if any."""
        self._walk, self._position = [], {}
        first: BaseException | None = None
        try:
            self._wait_write()
        except BaseException as exc:
            first = exc
        for read in self._reads.values():
            first = self._drain(read.handle) or first
            self._idle.append(read.handle)
            self.swapper.swap_buffer_manager.free(read.buffers)
        self._reads.clear()
        if first is not None:
            raise first

    def _wait_write(self) -> None:
        if self._writer is None or not self._writing:
            return
        buffers, self._writing = self._writing, []
        try:
            self._writer.wait()
        finally:
            self.swapper.swap_buffer_manager.free(buffers)  # quiescent even when an op failed

    @staticmethod
    def _drain(handle: ExtentSwapHandle) -> BaseException | None:
        try:
            handle.wait()
        except BaseException as exc:  # the handle drains everything before it raises
            return exc
        return None

    def _pid(self, parameter: torch.Tensor) -> str:
        return str(parameter.ds_id)  # type: ignore[attr-defined]  # OptimizerSwapper.parameter_id
