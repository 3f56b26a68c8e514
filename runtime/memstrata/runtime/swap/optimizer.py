"""memstrata's optimizer-state swapper: sub-groups streamed to NVMe extents, exact buffers, a DRAM cache.

DeepSpeed's PartitionedOptimizerSwapper pins `buffer_count` x the largest
sub-group of fp32 at construction (4 x 1e9 x 4 B by default) and swaps through
files. This subclass keeps its bookkeeping (which tensors of a sub-group are
state, where gradient fragments go) and replaces the three things that cost
memory or bypass memstrata:

- I/O: the aio handle is an `ExtentSwapHandle` (extents striped over every
  namespace of the NVMe stratum, one I/O token per stratum per node);
- buffers: `ExactBuffers` hands out exactly `count` buffers of the requested
  size from the rank's locked pool, and takes them back after the swap-out;
- the cache: `cache_subgroups` (K) sub-groups whose state is fully in locked
  buffers stay in DRAM across steps: their swap-out writes nothing and their
  next swap-in reads only the gradients. With memstrata.runtime.swap.suborder the
  order is reversed every step and the K walked last are kept (`keep_ids`),
  MLP-Offload's policy; without it, the first K cacheable ones stay for good.
- construction: each NVMe sub-group's fp32 master is written a chunk at a time
  (INIT_CHUNK elements) from its 16-bit source, in DRAM or on NVMe (fast_init,
  which memstrata.runtime.initialize turns on unless the config sets it; a sub-group
  of several tensors on NVMe is read whole, under 2 sub-group units);
- gradients: with memstrata.runtime.swap.gradients installed, none are swapped; a
  sub-group's fp32 gradients are widened from DRAM into one exact buffer when
  its state is swapped in, and freed with it.
- the pipeline (memstrata.runtime.swap.readahead): inside a step's walk the next
  `prefetch_subgroups` sub-groups are read while Adam runs and each write-back
  completes behind the next sub-group's update.
"""
from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable
from typing import Any, cast

import torch
from deepspeed import comm as dist
from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper
from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
from deepspeed.runtime.swap_tensor.utils import swap_in_tensors

from memstrata.runtime.swap import layer as swaplayer
from memstrata.runtime.swap.adamstate import ADAM_STATE, name_state, zero_started_adam
from memstrata.runtime.swap.gradients import DramGradients, config_dict
from memstrata.runtime.strata.pinned import LockedPool
from memstrata.runtime.swap.protocols import SwapInfo
from memstrata.runtime.swap.readahead import ReadAhead

__all__ = ["MemstrataOptimizerSwapper", "ExactBuffers", "fast_init_config"]

# Elements per chunk when a sub-group's fp32 master is first written (4 MiB of fp32; whole blocks of both dtypes).
INIT_CHUNK = 1 << 20
# One piece of a sub-group's 16-bit parameters, as ZeRO-3 hands it to fast_init: the partition, its numel,
# and its swap name (None: the partition is in memory, not swapped).
_Fp16Part = tuple[torch.Tensor, int, str | None]


def fast_init_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any] | str | os.PathLike[str]:
    """The ds_config with `offload_optimizer.fast_init` on where the 16-bit weights and the optimizer state both go
    to NVMe and the user did not set it: ZeRO-3 then hands the weights' NVMe partitions to this swapper
    (`initialize_from_swapped_fp16_params`, a chunk at a time) instead of widening each sub-group into an fp32 copy
    of its own first. The same values: both widen the same 16-bit partitions. Pure: a new dict, or the argument."""
    cfg = config_dict(config)
    zero = (cfg or {}).get("zero_optimization") or {}
    optim, param = zero.get("offload_optimizer") or {}, zero.get("offload_param") or {}
    if cfg is None or optim.get("device") != "nvme" or param.get("device") != "nvme" or "fast_init" in optim:
        return config
    out = copy.deepcopy(cfg)
    out["zero_optimization"]["offload_optimizer"]["fast_init"] = True
    return out


class ExactBuffers:
    """SwapBufferManager's interface over a LockedPool: buffers of exactly the size asked for."""

    def __init__(self, pool: LockedPool, dtype: torch.dtype, spare_count: int) -> None:
        self.pool, self.dtype = pool, dtype
        self.spare_count = spare_count  # what allocate_all hands out (gradient staging, init)
        # Stock's swapped-gradient path fills only the fragments it swapped: the rest of a gradient buffer
        # must read as zero, as in DeepSpeed's pool. memstrata.runtime.swap.gradients fills every byte and turns
        # this off, saving a memset of each sub-group's state per update.
        self.zero_new = True
        self._live: dict[int, torch.Tensor] = {}

    def allocate(self, num_elems: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
        if dtype != self.dtype:
            raise TypeError(f"optimizer swap buffers are {self.dtype}, asked for {dtype}")
        out = [self.pool.tensor(int(num_elems), dtype) for _ in range(count)]
        if self.zero_new:
            for t in out:
                t.zero_()
        for t in out:
            self._live[id(t)] = t
        return out

    def allocate_all(self, num_elems: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return self.allocate(num_elems, self.spare_count, dtype)

    def free(self, buffers: list[torch.Tensor]) -> None:
        for t in buffers:
            if self._live.pop(id(t), None) is None:
                raise RuntimeError("optimizer swap buffer freed twice or not from this manager")
            self.pool.free(t)


def _copier(flat: torch.Tensor) -> Callable[[torch.Tensor, int], None]:
    """A chunk filler for `_write_master` from a tensor in memory: elements [at, at + len(dst)) of `flat`."""
    def fill(dst: torch.Tensor, at: int) -> None:
        dst.copy_(flat.narrow(0, at, dst.numel()))

    return fill


class MemstrataOptimizerSwapper(PartitionedOptimizerSwapper):
    def __init__(self, swap_config: object, aio_config: object, base_folder: str, optimizer: torch.optim.Optimizer,
                 largest_numel: int, device: object, dtype: torch.dtype, timers: object) -> None:
        # Deliberately not super().__init__: that loads the aio op, creates the swap folder and pins
        # buffer_count x largest sub-group. The same attributes (seam: Kind.RECREATED), no side effects.
        layer = swaplayer.active()
        self.layer = layer
        self.swap_config, self.aio_config = swap_config, aio_config
        self.aio_handle = layer.handle("optimizer")
        self.swap_params_info: dict[str, SwapInfo] = {}
        self.swap_element_size = torch.tensor([], dtype=dtype).element_size()
        self.swap_folder = os.path.join(f"memstrata:/optimizer/rank{dist.get_rank()}")
        self.optimizer = optimizer
        self.min_aio_bytes = layer.settings.min_swap_bytes
        self.aligned_bytes = 4096
        self.numel_alignment = self.aligned_bytes // self.swap_element_size
        self.largest_numel = self._io_aligned_numel(largest_numel)
        self.dtype = dtype
        self.swap_buffer_manager = ExactBuffers(layer.pool, dtype, spare_count=2)
        self.timers, self.timer_names = timers, set[str]()
        self.print_exclude_list = ["optimizer", "swap_buffer_manager", "swap_params_info", "timers",
                                   "timer_names", "aio_handle", "gradient_swapper", "print_exclude_list", "layer"]
        self.gradient_swapper = AsyncTensorSwapper(aio_handle=self.aio_handle, numel_alignment=self.numel_alignment,
                                                   timers=self.timers)
        self._cached: dict[str, list[torch.Tensor]] = {}  # param id -> its state buffers, kept in DRAM
        self._cache_slots = layer.settings.cache_subgroups
        # Set each step by memstrata.runtime.swap.suborder: the sub-groups walked last, which the next (reversed)
        # step walks first. None without that hook: then the first K cacheable sub-groups stay for good.
        self.keep_ids: set[str] | None = None
        # Set by memstrata.runtime.swap.gradients: gradients of NVMe sub-groups stay in DRAM, never swapped.
        self.dram_gradients: DramGradients | None = None
        # Inert (stock's synchronous path) until memstrata.runtime.swap.suborder hands it a step's walk.
        self.readahead = ReadAhead(self, layer.settings.prefetch_subgroups)
        self._init_scratch: list[torch.Tensor] = []  # a chunk reader's 16-bit buffer, freed with its tensor's
        self.stepping = False  # inside the optimizer's step() (memstrata.runtime.swap.integration sets it)

    def use_dram_gradients(self, grads: DramGradients) -> DramGradients:
        """From now on the update widens gradients from `grads` (memstrata.runtime.swap.gradients)."""
        self.dram_gradients = grads
        # Every byte of a sub-group's gradient buffer is now written by fill_fp32_gradients before use,
        # so new buffers need no memset (stock's gradient path leaves holes, hence zeroing until now).
        self.swap_buffer_manager.zero_new = False
        return grads

    # -- cache -------------------------------------------------------------------------------------
    def swap_in_optimizer_state(self, parameter: torch.Tensor, async_parameter: object = None) -> None:
        info: SwapInfo | None = self._get_param_swap_info(parameter)
        if info is None:
            return
        cached = self._cached.get(info.param_id)
        if cached is None or len(cached) != info.num_tensors():
            if cached is not None:  # state tensors appeared since it was cached: re-read everything
                self._drop_cached(info.param_id)
            read = self.readahead.take(parameter, info)
            if read is None:
                super().swap_in_optimizer_state(parameter, async_parameter)
            else:
                self._flush_gradient_swapper(self.gradient_swapper)
                self._bind_state(parameter, info, read)
            if self.stepping and not info.has_state_tensors:
                self._first_moments(parameter, info)
            self._widen_dram_gradients(parameter, info)
            return
        self.readahead.top_up(parameter)  # nothing to read here; the next ones still are
        self._flush_gradient_swapper(self.gradient_swapper)
        self.layer.cache_hits += 1
        self._bind_state(parameter, info, cached)
        self._widen_dram_gradients(parameter, info)

    def _first_moments(self, parameter: torch.Tensor, info: SwapInfo) -> None:
        """The first update of a streamed sub-group: its Adam moments start as zeros in two more exact buffers,
        registered as its state tensors beside the master, as DeepSpeedCPUAdam would create them (step 0, zeros).
        Adam then updates them in place and the write-back sends them from the pool, as in every later step; stock
        lets Adam allocate them (8 B x the sub-group) and stages their first write through two more buffers."""
        opt = self.optimizer
        if not zero_started_adam(opt) or opt.state.get(parameter):
            return
        n, aligned = info.numel(), self._io_aligned_numel(info.numel())
        fresh = self.swap_buffer_manager.allocate(aligned, 2, self.dtype)
        moments = [name_state(buf.zero_().narrow(0, 0, n), parameter, name) for name, buf in zip(ADAM_STATE, fresh)]
        opt.state[parameter].update(step=0, **dict(zip(ADAM_STATE, moments)))
        cast(Any, info).add_state_tensors(moments)
        state_buffers = info.swap_buffers[:1] + fresh  # the master's buffer, then the moments'
        info.set_swap_buffers(state_buffers, aligned)
        info.swap_buffers = state_buffers + info.swap_buffers[1:]

    def _bind_state(self, parameter: torch.Tensor, info: SwapInfo, buffers: list[torch.Tensor]) -> None:
        """Make `buffers` (already holding the state) the sub-group's tensors; read its swapped gradients."""
        aligned = self._io_aligned_numel(info.numel())
        info.set_swap_buffers(buffers, aligned)
        info.swap_buffers = list(buffers)
        if info.has_gradients():
            grad_buf = self.swap_buffer_manager.allocate(aligned, 1, parameter.dtype)
            info.swap_buffers += grad_buf
            self._swap_in_gradients(aio_handle=self.aio_handle, parameter=parameter, dest_buffer=grad_buf[0])

    def _widen_dram_gradients(self, parameter: torch.Tensor, info: SwapInfo) -> None:
        """With memstrata.runtime.swap.gradients installed: this sub-group's fp32 gradients, widened from DRAM
        into one exact buffer that is released with the state buffers."""
        grads = self.dram_gradients
        if grads is None or not grads.holds(parameter) or info.has_gradients():
            return
        buf = self.swap_buffer_manager.allocate(self._io_aligned_numel(info.numel()), 1, parameter.dtype)[0]
        grads.fill_fp32_gradients(parameter, buf)
        info.swap_buffers.append(buf)
        parameter.grad = buf.narrow(0, 0, parameter.numel())

    def swap_out_optimizer_state(self, parameter: torch.Tensor, async_swap: bool = False) -> None:
        info: SwapInfo | None = self._get_param_swap_info(parameter)
        if info is None:
            return
        pid = info.param_id
        n = info.num_tensors()
        state_buffers = info.swap_buffers[:n]
        cacheable = (info.has_state_tensors and len(state_buffers) == n
                     and all(self.layer.pool.owns(t) for t in info.get_compute_tensors()))
        if self.keep_ids is not None:
            if pid in self.keep_ids and info.has_state_tensors and not cacheable:
                # First step: Adam created its moments as ordinary tensors. Move them into exact pool
                # buffers so this sub-group can be kept, instead of missing the cache for a whole step.
                state_buffers, cacheable = self._adopt_into_pool(info), True
            keep = cacheable and pid in self.keep_ids
            if not keep and pid in self._cached:
                # Evicted: the DRAM copy is the only current one, so write it back like any other sub-group.
                self._drop_cached(pid, keep_buffers_for=info)
        else:
            keep = pid in self._cached or (cacheable and len(self._cached) < self._cache_slots)
        if keep:
            if pid not in self._cached:
                self.layer.cache_bytes += sum(t.numel() * t.element_size() for t in state_buffers)
            self._cached[pid] = state_buffers
            # Free only what is not cached (the gradient buffer); the state stays in DRAM.
            extra = info.swap_buffers[n:]
            info.swap_buffers = []
            info.release_memory()
            self.swap_buffer_manager.free(extra)
            info.release_unswapped_gradients()
            return
        if not self.readahead.write_back(info):
            super().swap_out_optimizer_state(parameter, async_swap)

    def _adopt_into_pool(self, info: SwapInfo) -> list[torch.Tensor]:
        """Copy every compute tensor of `info` into fresh pool buffers and rebind it there; the old swap
        buffers stay in `info.swap_buffers` after the new ones, for the caller to free."""
        aligned = self._io_aligned_numel(info.numel())
        fresh = self.swap_buffer_manager.allocate(aligned, info.num_tensors(), self.dtype)
        for buf, t in zip(fresh, info.get_compute_tensors()):
            buf.narrow(0, 0, t.numel()).copy_(t.reshape(-1))
        old = info.swap_buffers
        info.set_swap_buffers(fresh, aligned)
        info.swap_buffers = fresh + old
        return fresh

    def release_swap_buffers(self, parameter: torch.Tensor) -> None:
        info: SwapInfo | None = self._get_param_swap_info(parameter)
        if info is not None and info.param_id in self._cached:
            n = info.num_tensors()
            extra = info.swap_buffers[n:]
            info.swap_buffers = []
            info.release_memory()
            self.swap_buffer_manager.free(extra)
            return
        super().release_swap_buffers(parameter)

    def writeback_optimizer_state_and_gradients(self, parameter: torch.Tensor, write_opt_state: bool,
                                                write_gradients: bool) -> None:
        info: SwapInfo | None = self._get_param_swap_info(parameter)
        grads = self.dram_gradients
        if (write_gradients and info is not None and grads is not None and grads.holds(parameter)
                and not info.has_gradients() and parameter.grad is not None):
            # Nothing of this gradient is on NVMe for stock's write-back to update: it lives in DRAM.
            grads.store_fp32_gradients(parameter, parameter.grad)
        if info is not None and info.param_id in self._cached:
            # The cached copy is the truth; a state write-back must reach NVMe, so uncache it.
            if write_opt_state:
                self._drop_cached(info.param_id, keep_buffers_for=info)
        super().writeback_optimizer_state_and_gradients(parameter, write_opt_state, write_gradients)

    def _drop_cached(self, pid: str, keep_buffers_for: SwapInfo | None = None) -> None:
        bufs = self._cached.pop(pid)
        self.layer.cache_bytes -= sum(t.numel() * t.element_size() for t in bufs)
        if keep_buffers_for is None:
            self.swap_buffer_manager.free(bufs)

    # -- construction -------------------------------------------------------------------------------
    # Stock builds each NVMe sub-group's fp32 master by staging it through `allocate_all` of the largest
    # sub-group (two buffers: 8 B x the embedding, 2.1 GB for Llama-3.2-1B's) and, for 16-bit weights on NVMe
    # without fast_init, an fp32 copy of the whole sub-group besides. Here a tensor streams through one exact buffer
    # of at most INIT_CHUNK elements, so construction needs no more than an update does.
    def initialize_parameters(self, parameters: list[torch.Tensor], src_tensors: list[torch.Tensor]) -> None:
        paths = self._get_swap_paths(parameters=parameters, num_elems=[src.numel() for src in src_tensors])
        for src, path in zip(src_tensors, paths):
            self._write_master(path, src.numel(), _copier(src.reshape(-1)))

    def initialize_from_swapped_fp16_params(self, fp16_partitions_info: list[list[_Fp16Part]],
                                            fp16_num_elems: list[int], fp16_pinned_buffers: list[torch.Tensor],
                                            fp32_parameters: list[torch.Tensor]) -> None:
        paths = self._get_swap_paths(parameters=fp32_parameters, num_elems=fp16_num_elems)
        # The weights' dtype: the parameter swapper's buffers have it (a partition on NVMe holds a 1-element
        # placeholder of another dtype).
        dtype = fp16_pinned_buffers[0].dtype
        for parts, numel, path in zip(fp16_partitions_info, fp16_num_elems, paths):
            if len(parts) == 1 and parts[0][2] is not None:  # one tensor on NVMe: read it a chunk at a time
                self._write_master(path, numel, self._chunk_reader(str(parts[0][2]), dtype))
            else:  # several tensors, together under 2 sub-group units: whole
                self._fast_init_whole(parts, numel, path, dtype)

    def _chunk_reader(self, part_path: str, dtype: torch.dtype) -> Callable[[torch.Tensor, int], None]:
        size = torch.tensor([], dtype=dtype).element_size()
        stored = int(self.aio_handle.extent_of(part_path).nbytes // size)
        half = self.layer.pool.tensor(min(INIT_CHUNK, stored), dtype)
        self._init_scratch.append(half)

        def fill(dst: torch.Tensor, at: int) -> None:
            n = min(half.numel(), stored - at)
            self.aio_handle.read_part(half.narrow(0, 0, n), part_path, at * size)
            self.aio_handle.wait()
            dst.copy_(half.narrow(0, 0, dst.numel()))

        return fill

    def _write_master(self, path: str, numel: int, fill: Callable[[torch.Tensor, int], None]) -> None:
        """Write the fp32 tensor `path` of `numel` elements, chunk by chunk, `fill(dst, at)` giving elements
        [at, at + len(dst)); the alignment padding is zeros."""
        aligned = self._io_aligned_numel(numel)
        buf: torch.Tensor | None = None
        try:
            self.aio_handle.reserve(path, aligned * self.swap_element_size)
            buf = self.swap_buffer_manager.allocate(min(INIT_CHUNK, aligned), 1, self.dtype)[0]
            for at in range(0, aligned, buf.numel()):
                n_io, n = min(buf.numel(), aligned - at), max(0, min(buf.numel(), numel - at))
                if n:
                    fill(buf.narrow(0, 0, n), at)
                buf.narrow(0, n, n_io - n).zero_()
                self.aio_handle.write_part(buf.narrow(0, 0, n_io), path, at * self.swap_element_size)
                self.aio_handle.wait()
        except BaseException:
            with contextlib.suppress(BaseException):  # nothing may still be written from `buf` once it is freed
                self.aio_handle.wait()
            raise
        finally:
            if buf is not None:
                self.swap_buffer_manager.free([buf])
            for t in self._init_scratch:
                self.layer.pool.free(t)
            self._init_scratch.clear()

    def _fast_init_whole(self, parts: list[_Fp16Part], numel: int, path: str, dtype: torch.dtype) -> None:
        reads, dsts = [], []
        fp32 = self.swap_buffer_manager.allocate(self._io_aligned_numel(numel), 1, self.dtype)[0]
        fp16 = self.layer.pool.tensor(self._io_aligned_numel(numel), dtype)
        offset = 0
        for tensor, part_numel, part_path in parts:
            dst = fp16.narrow(0, offset, part_numel)
            if part_path is None:
                dst.copy_(tensor.data)
            else:
                reads.append(part_path)
                dsts.append(dst)
            offset += part_numel
        if reads:
            swap_in_tensors(self.aio_handle, dsts, reads)
            self.aio_handle.wait()
        fp32.narrow(0, 0, numel).copy_(fp16.narrow(0, 0, numel))
        self.layer.pool.free(fp16)
        self.aio_handle.async_pwrite(fp32, path)
        self.aio_handle.wait()
        self.swap_buffer_manager.free([fp32])
