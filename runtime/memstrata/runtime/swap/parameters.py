"""memstrata's parameter swapper: DeepSpeed's AsyncPartitionedParameterSwapper on extents, with exact buffers.

DeepSpeed's swapper pins `buffer_count` buffers of `buffer_size` elements up
front, asserts "More elements than buffer size" for a larger parameter and
"Not enough buffers" when more are live than it has slots. Here every
partition gets a buffer of exactly its own (4 KiB-aligned) size from the
rank's `LockedPool` when it is swapped in, returned when it is released; the
prefetcher is told how many more fit in the staging budget, so it never
over-commits, and a fetch that must happen is never refused. I/O goes through
`ExtentSwapHandle`, so no swap folder is created and no file is written.

A released buffer goes back to the pool only once no tensor views it any more,
and on a GPU only once the copies queued on it have run: the pool is registered
with the GPU, so the copy of a partition to the device is asynchronous DMA, and
the buffer's free is fenced on the stream current at its release and the one
current when it was filled. ZeRO-3 copies a partition to the device on its
all-gather stream, and the compute stream waits for that stream before it
computes with the parameter, so the release (after the computation) is ordered
after the copy; a synchronous fetch fills and copies on the all-gather stream
itself, which the second fence covers. (An asynchronous NVMe prefetch fills on
the compute stream; its copy is then ordered by that wait as well.)
On a rank whose partition is the whole parameter (one rank, and on the CPU),
ZeRO-3 does not gather into a fresh tensor: `param.data` *is* the staging
buffer. Autograd can keep that storage past the release: non-reentrant
activation checkpointing recomputes a block's forward inside backward, saving
the weights it gathers, and ZeRO-3 releases them when that recomputed forward
ends, before the backward ops that read them run. A torch allocation outlives
such a reference by reference counting; a pool region does not, so the buffer
would be handed to the next parameter while backward still reads it as this
one. Such a buffer lingers (still counted in use) until its storage is freed.

Only buffer ownership and I/O are replaced; the status bookkeeping that
ZeRO-3's coordinator reads (`ds_tensor.status`, `available_params`, ...) is
DeepSpeed's own.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from deepspeed import comm as dist
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (AsyncPartitionedParameterSwapper,
                                                                     PartitionedParamStatus)
from deepspeed.runtime.swap_tensor.utils import swap_in_tensors, swap_out_tensors

from memstrata.runtime.swap import layer as swaplayer
from memstrata.runtime.swap.protocols import DsConfig, ZeroParam

__all__ = ["MemstrataParamSwapper"]


class _Lingering:
    """A released staging buffer that a tensor outside the swapper still views: its storage, weakly, and the
    address and size `LockedPool.free` needs once that storage is gone."""

    __slots__ = ("storage", "address", "nbytes", "streams")

    def __init__(self, storage: StorageWeakRef, address: int, nbytes: int, streams: tuple[Any, ...]) -> None:
        self.storage, self.address, self.nbytes, self.streams = storage, address, nbytes, streams


class MemstrataParamSwapper(AsyncPartitionedParameterSwapper):
    def _configure_aio(self, ds_config: DsConfig) -> None:
        # Replaces stock's: no swap folder, no aio op, no pinned slab. It sets the same attributes
        # (seam: Kind.RECREATED), which stock's __init__ and the methods not overridden here read.
        layer = swaplayer.active()
        self.layer = layer
        self.swap_config = ds_config.zero_config.offload_param
        dtype_name = str(self.dtype).split(".")[1]
        # A name space for extents, not a directory: nothing is created on disk.
        self.swap_folder = f"memstrata:/params/{dtype_name}/rank{dist.get_rank()}"
        self.swap_element_size = torch.tensor([], dtype=self.dtype).element_size()
        self.aio_config = ds_config.aio_config
        self.use_gds = False
        self.min_aio_bytes = layer.settings.min_swap_bytes
        # 4 KiB-aligned lengths keep every transfer in place (no bounce region).
        self.aligned_bytes = 4096
        self.numel_alignment = self.aligned_bytes // self.swap_element_size
        self.elements_per_buffer = 1 << 62  # no per-buffer ceiling: buffers are exact
        self.aligned_elements_per_buffer = self.elements_per_buffer
        self.param_buffer_count = 0
        self.available_buffer_ids: list[int] = []
        self.reserved_buffer_ids: list[int] = []
        # Two handles, as DeepSpeed has: each wait() completes (and counts) only its own ops.
        self.aio_read_handle = layer.handle("param")
        self.aio_write_handle = layer.handle("param")
        self.buffers = None
        self.swap_out_params: list[ZeroParam] = []
        self._reserved: list[torch.Tensor] = []
        self._lingering: list[_Lingering] = []
        self._filled_on: dict[int, Any] = {}  # ds_id -> the stream current when its buffer was handed out (GPU)

    def swappable_tensor(self, param: ZeroParam | None = None, numel: int | None = None) -> bool:
        """Whether a partition goes to NVMe. ZeRO-3 asks once per parameter, when it first partitions it
        (partition_parameters.py); the plan's DRAM share of the weights (`resident_weight_bytes`) is spent
        there, in construction order, first-fit: a partition that fits what is left stays in DRAM for good."""
        if param is not None:  # a query about a partition already placed: where it went
            return param.ds_tensor is not None and getattr(param.ds_tensor, "final_location", None) == "nvme"
        if numel is None or not super().swappable_tensor(numel=numel):
            return False
        budget = self.layer.settings.resident_weight_bytes
        nbytes = int(numel) * self.swap_element_size
        if budget is not None and self.layer.resident_weight_bytes + nbytes <= budget:
            self.layer.resident_weight_bytes += nbytes
            return False
        return True

    # -- buffers -----------------------------------------------------------------------------------
    def available_swap_in_buffers(self) -> int:
        """How many more partitions the prefetcher may bring in: what fits the staging budget."""
        self._free_lingering()
        budget = self.layer.settings.param_staging_bytes
        largest = max(self.param_id_to_numel.values(), default=1) * self.swap_element_size
        return max(0, int((budget - self.layer.param_bytes_in_use) // max(largest, 1)))

    def _new_buffer(self, param: ZeroParam, numel: int) -> torch.Tensor:
        self._free_lingering()
        aligned = self._io_aligned_numel(numel)
        buf = self.layer.param_pool.tensor(aligned, self.dtype)
        if self.layer.dma is not None:
            self._filled_on[param.ds_id] = self.layer.dma.current_stream()
        self.param_id_to_buffer_id[param.ds_id] = buf.data_ptr()
        self.param_id_to_swap_buffer[param.ds_id] = buf
        self.layer.param_bytes_in_use += aligned * self.swap_element_size
        return buf

    def _allocate_and_return_buffers_for_swap_in(self, params: list[ZeroParam]) -> tuple[list[torch.Tensor],
                                                                                        list[torch.Tensor]]:
        compute, swap = [], []
        for param in params:
            if param.ds_id not in self.param_id_to_numel:
                raise RuntimeError(f"parameter {param.ds_id} was never swapped out, its size is unknown")
            if param.ds_id in self.param_id_to_swap_buffer:
                raise RuntimeError(f"parameter {param.ds_id} already holds a swap buffer")
            buf = self._new_buffer(param, self.param_id_to_numel[param.ds_id])
            swap.append(buf)
            compute.append(buf.narrow(0, 0, self.param_id_to_numel[param.ds_id]))
        return compute, swap

    def get_buffer(self, param: ZeroParam, numel: int) -> torch.Tensor:
        self.param_id_to_numel[param.ds_id] = numel
        return self._new_buffer(param, numel).narrow(0, 0, numel)

    def _release_buffer(self, pid: int) -> None:
        """Give parameter `pid`'s buffer back to the pool, or, while a tensor elsewhere (autograd) still views its
        storage, once that tensor is gone. Its ds_tensor must no longer point at it."""
        buf = self.param_id_to_swap_buffer.pop(pid)
        del self.param_id_to_buffer_id[pid]
        filled_on = self._filled_on.pop(pid, None)
        self._lingering.append(_Lingering(StorageWeakRef(buf.untyped_storage()), buf.untyped_storage().data_ptr(),
                                          buf.numel() * self.swap_element_size,
                                          (filled_on,) if filled_on is not None else ()))
        del buf  # the swapper's last reference: from here on only outside views keep the storage alive
        self._free_lingering()

    def _free_lingering(self) -> None:
        still = []
        for buf in self._lingering:
            if buf.storage.expired():
                self.layer.param_bytes_in_use -= buf.nbytes
                self.layer.param_pool.free(buf.address, streams=buf.streams)
            else:
                still.append(buf)
        self._lingering = still

    def remove_partition_and_release_buffers(self, params: list[ZeroParam]) -> None:
        for param in params:
            pid = param.ds_id
            param.ds_tensor.data = self.invalid_buffer.data
            param.ds_tensor.status = PartitionedParamStatus.NOT_AVAILABLE
            if pid in self.param_id_to_swap_buffer:
                if pid in self.available_params:
                    self.available_params.remove(pid)
                    self.available_numel -= self.param_id_to_numel[pid]
                self._release_buffer(pid)

    def forget_except(self, live: set[int]) -> int:
        """Free the extents of parameters not in `live` (ds_ids) and return their bytes. A model built under
        zero.Init swaps out each parameter as its module is built; one replaced afterwards - the LM head's
        own weight when `transformers` ties it to the embedding - would otherwise hold its extent for the
        whole run."""
        freed = 0
        for pid in [p for p in self.id_to_path if p not in live]:
            if pid in self.param_id_to_swap_buffer:
                continue  # gathered right now: in use, whoever owns it
            if self.aio_write_handle.discard(self.id_to_path.pop(pid)):
                freed += self.param_id_to_numel.pop(pid, 0) * self.swap_element_size
        return freed

    # -- the 16-bit write-back after an update, through exact buffers ------------------------------------------
    def reserve_partitioned_swap_space(self, partition_num_elems: list[int]) -> None:
        """Stock locks a buffer for the largest sub-group's 16-bit partitions here, for the whole run (2 B x the
        embedding); `swap_out_partitioned_params` takes exact buffers per call instead (a sub-group updated a
        slice at a time writes its slices itself, memstrata.runtime.swap.sliced)."""

    def swap_out_partitioned_params(self, dst_fp16_params: list[ZeroParam], src_fp32_params: list[torch.Tensor]
                                    ) -> None:
        """Cast each updated fp32 partition to the 16-bit dtype in an exact buffer and write it to its extent; the
        buffers are freed once written."""
        if len(dst_fp16_params) != len(src_fp32_params):
            raise ValueError(f"{len(dst_fp16_params)} 16-bit parameters for {len(src_fp32_params)} fp32 partitions")
        paths = self._get_swap_paths(dst_fp16_params, must_exist=True)
        self.synchronize_writes()
        buffers: list[torch.Tensor] = []
        try:
            for src in src_fp32_params:
                buf = self.layer.param_pool.tensor(self._io_aligned_numel(src.numel()), self.dtype)
                buffers.append(buf)
                buf.narrow(0, src.numel(), buf.numel() - src.numel()).zero_()
                buf.narrow(0, 0, src.numel()).copy_(src.reshape(-1))
            swap_out_tensors(self.aio_write_handle, buffers, paths)
        finally:
            try:
                self.aio_write_handle.wait()
            finally:
                for buf in buffers:
                    self.layer.param_pool.free(buf)
        for param in dst_fp16_params:
            param.ds_tensor.status = PartitionedParamStatus.NOT_AVAILABLE

    def reserve_available_buffers(self) -> list[torch.Tensor]:
        # Only used by the optimizer's fast_init, which memstrata's optimizer swapper does
        # without borrowing parameter buffers; ZeRO-3 asserts the list is non-empty.
        self._reserved = [self.layer.param_pool.tensor(self.numel_alignment, self.dtype)]
        return list(self._reserved)

    def release_reserved_buffers(self) -> None:
        for buf in self._reserved:
            self.layer.param_pool.free(buf)
        self._reserved = []

    # -- swap in without the fixed-slot assertion ------------------------------------------------------
    def swap_in(self, params: list[ZeroParam], async_op: bool = True,
                swap_in_buffers: list[torch.Tensor] | None = None) -> None:
        if swap_in_buffers is None:
            # The prefetcher walks the trace, where a tied weight (embedding = LM head) appears
            # twice; DeepSpeed would assert on the second. One read serves both uses.
            params = list({id(p): p for p in params}.values())
        not_ready = [p.ds_id for p in params if p.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE]
        if not_ready:
            raise RuntimeError(f"parameters {not_ready} are already available or in flight")
        paths = self._get_swap_paths(params)
        if swap_in_buffers is None:
            compute, swap_in_buffers = self._allocate_and_return_buffers_for_swap_in(params)
            inflight = sum(t.numel() for t in compute)
        else:
            inflight = sum(t.numel() for t in swap_in_buffers)
        swap_in_tensors(self.aio_read_handle, swap_in_buffers, paths)
        self._update_inflight_swap_in(params, swap_in_buffers, inflight)
        if not async_op:
            self.synchronize_reads()
