"""Activation checkpoints off the compute device, into host memory the plan chose.

With gradient checkpointing each layer keeps one tensor from forward to backward:
its input hidden state, [b, s, h] in the training precision (what the planner's
`checkpoints` category counts). `ActivationOffload.checkpoint` is the function
Hugging Face calls for every checkpointed layer: it runs torch's non-reentrant
checkpoint under saved-tensor hooks, so the one tensor the checkpoint saves is
copied into the activation pool (interleaved over the CXL nodes when the node
has them, DRAM otherwise: memstrata.runtime.strata.affinity) instead of staying
on the GPU.

Backward unpacks them last layer first. On a GPU the copies run on a side
stream: each checkpoint leaves the device without stalling the forward, and
unpacking layer i starts the copy of layer i-1 back, so the next recompute finds
its input already there. A host buffer returns to the pool only once its copy
back has completed. On the CPU the same pool holds them (placed by the plan's
NUMA nodes), so the bytes the plan counts are the bytes the pool measures.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from memstrata.runtime.strata.pinned import LockedPool

__all__ = ["ActivationOffload", "ActivationStats"]


@dataclass
class _Saved:
    host: torch.Tensor  # flat, in the pool
    shape: torch.Size
    device: torch.device
    stored: Any = None  # CUDA event: the copy to the host has completed
    back: torch.Tensor | None = None  # the copy on its way back to the device (prefetched)
    arrived: Any = None  # CUDA event: `back` is complete


@dataclass
class ActivationStats:
    """What the offload moved: per step, `live_peak_bytes` is what the plan's `checkpoints` category counts."""

    live_bytes: int = 0
    live_peak_bytes: int = 0
    offloaded_bytes: int = 0  # copied off the device, all steps
    returned_bytes: int = 0  # copied back for backward, all steps
    prefetched: int = 0  # checkpoints already on their way back when backward asked for them
    tensors: int = 0


class ActivationOffload:
    """The gradient-checkpointing function that keeps each layer's checkpoint in `pool`."""

    def __init__(self, pool: LockedPool) -> None:
        self.pool = pool
        self.stats = ActivationStats()
        self._saved: dict[int, _Saved] = {}
        self._next = 0
        self._stream: Any = None  # one side stream per device, made on first use
        self._returning: list[tuple[Any, torch.Tensor]] = []  # (event, host buffer) freed once the event is done

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """What `model._set_gradient_checkpointing(gradient_checkpointing_func=...)` calls per layer."""
        kwargs.pop("use_reentrant", None)  # the reentrant variant saves no tensors through these hooks
        with saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)

    # -- hooks ------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> int:
        self._reap()
        host = self.pool.tensor(tensor.numel(), tensor.dtype)
        saved = _Saved(host=host, shape=tensor.shape, device=tensor.device)
        source = tensor.detach().reshape(-1)
        if tensor.is_cuda:
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written by then
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
                saved.stored = torch.cuda.Event()
                saved.stored.record(stream)
            source.record_stream(stream)  # the allocator must not reuse it before the copy is done
        else:
            host.copy_(source)
        key, self._next = self._next, self._next + 1
        self._saved[key] = saved
        nbytes = host.numel() * host.element_size()
        s = self.stats
        s.live_bytes += nbytes
        s.live_peak_bytes = max(s.live_peak_bytes, s.live_bytes)
        s.offloaded_bytes += nbytes
        s.tensors += 1
        return key

    def _unpack(self, key: int) -> torch.Tensor:
        saved = self._saved.pop(key)
        self.stats.returned_bytes += saved.host.numel() * saved.host.element_size()
        if saved.device.type != "cuda":
            out = saved.host.view(saved.shape).clone()
            self._release(saved.host)
            return out
        back = saved.back
        if back is None:
            back = self._fetch(saved)
        else:
            self.stats.prefetched += 1
        torch.cuda.current_stream(saved.device).wait_event(saved.arrived)
        # Backward runs last layer first: the next checkpoint it needs is the one packed before this one.
        earlier = self._saved.get(key - 1)
        if earlier is not None and earlier.back is None and earlier.device.type == "cuda":
            self._fetch(earlier)
        return back.view(saved.shape)

    def _fetch(self, saved: _Saved) -> torch.Tensor:
        """Start the copy back to the device; the host buffer is freed once it has completed (`_reap`)."""
        stream = self._side_stream(saved.device)
        with torch.cuda.stream(stream):
            stream.wait_event(saved.stored)
            back = torch.empty(saved.host.numel(), dtype=saved.host.dtype, device=saved.device)
            back.copy_(saved.host, non_blocking=True)
            saved.arrived = torch.cuda.Event()
            saved.arrived.record(stream)
        back.record_stream(torch.cuda.current_stream(saved.device))
        saved.back = back
        self._returning.append((saved.arrived, saved.host))
        return back

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _reap(self) -> None:
        """Return the host buffers whose copies back have completed."""
        keep = []
        for event, host in self._returning:
            if event.query():
                self._release(host)
            else:
                keep.append((event, host))
        self._returning = keep

    def _release(self, host: torch.Tensor) -> None:
        self.stats.live_bytes -= host.numel() * host.element_size()
        self.pool.free(host)

    def drop(self) -> int:
        """Free every checkpoint a backward never consumed (a forward whose loss was not backpropagated, or a
        step that failed between them); the number dropped. Safe between steps, a no-op after a backward."""
        for event, _ in self._returning:
            event.synchronize()
        self._reap()
        dropped = len(self._saved)
        for saved in self._saved.values():
            if saved.back is not None:
                continue  # prefetched: its host buffer was in `_returning`, freed above
            if saved.stored is not None:
                saved.stored.synchronize()
            self._release(saved.host)
        self._saved.clear()
        return dropped
