"""Activation checkpoints off the compute device, into host memory the plan chose.

With gradient checkpointing each layer keeps one tensor from forward to backward:
its input hidden state, [b, s, h] in the training precision (what the planner's
`checkpoints` category counts). `ActivationOffload.checkpoint` is the function
Hugging Face calls for every checkpointed layer: it runs torch's non-reentrant
checkpoint under saved-tensor hooks, so the tensors the checkpoint saves pass
through `_pack` and `_unpack`.

Not every saved tensor is a hidden state. torch up to 2.12 also saves a
zero-element float32 tensor on the CPU per checkpoint (its `_NoopSaveInputs`
dummy), whatever the compute device; a layer may take integer positions, a view,
an expanded mask. Only tensors worth moving go to the pool (`worth_offloading`:
on the compute device, laid out densely, at least a page); every other one is kept
as it is, exactly as autograd would have kept it. So the pool's bytes are the
plan's on a GPU as on the CPU.

A tensor keeps its strides: a dense but non-contiguous one (a transpose) is
copied span for span and comes back with the same layout.

Backward unpacks them last layer first. On a GPU the copies run on a side
stream: each checkpoint leaves the device without stalling the forward, and
unpacking one starts the copy back of what the layer before it offloaded, so the
next recompute finds its input already there. A host buffer goes back to the pool
when autograd lets go of its checkpoint (a saved tensor can be unpacked more than
once), with a fence on the side stream (memstrata.runtime.strata.dma), so the pool
reuses it only once its copies have run. On the CPU the same pool holds them (placed by the plan's NUMA nodes), so
the bytes the plan counts are the bytes the pool measures.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from memstrata.runtime.strata.pinned import ALIGN, LockedPool

__all__ = ["ActivationOffload", "ActivationStats", "worth_offloading"]


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a span of exactly numel elements (no overlap, no gaps): then one copy of the
    span moves it and `empty_strided` recreates its layout. An expanded tensor (stride 0) is not."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def worth_offloading(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a saved tensor goes to the pool: on the compute `device`, dense, and at least one page (a smaller
    one would cost a whole page of the pool and a copy to save nothing)."""
    return t.device == device and t.numel() * t.element_size() >= ALIGN and _dense(t)


class _Saved:
    """One offloaded checkpoint: what `_pack` hands autograd. Its host buffer goes back to the pool once the copy back
    has been queued (the first unpack), or when autograd lets go of a checkpoint it never unpacked, or at `drop()`.
    A saved tensor may be unpacked more than once (`ctx.saved_tensors` read twice, `retain_graph`): every unpack
    after the first returns the tensor the first one did, which autograd would have held all along without these
    hooks."""

    __slots__ = ("offload", "key", "host", "shape", "stride", "call", "stored", "back", "arrived", "freed",
                 "handed", "__weakref__")

    def __init__(self, offload: ActivationOffload, key: int, host: torch.Tensor, like: torch.Tensor,
                 call: int) -> None:
        self.offload, self.key, self.host = offload, key, host
        self.shape, self.stride = like.shape, like.stride()
        self.call = call  # which checkpointed layer call saved it (backward wants the one before next)
        self.stored: Any = None  # CUDA event: the copy to the host has completed
        self.back: torch.Tensor | None = None  # a copy on its way back to the device (prefetched), not yet handed out
        self.arrived: Any = None  # CUDA event: `back` is complete
        self.freed = False
        self.handed: torch.Tensor | None = None  # what the first unpack returned

    def on_host(self) -> torch.Tensor:
        return self.host.as_strided(self.shape, self.stride)

    def __del__(self) -> None:
        if not self.freed:
            try:
                self.offload._release(self)
            except Exception:  # noqa: BLE001 - at interpreter exit the pool or CUDA may be gone already
                pass


@dataclass
class ActivationStats:
    """What the offload moved: per step, `live_peak_bytes` is what the plan's `checkpoints` category counts."""

    live_bytes: int = 0
    live_peak_bytes: int = 0
    offloaded_bytes: int = 0  # copied off the device, all steps
    returned_bytes: int = 0  # copied back for backward, all steps
    prefetched: int = 0  # checkpoints already on their way back when backward asked for them
    tensors: int = 0  # offloaded
    kept: int = 0  # saved tensors left where they were (not worth moving)


class ActivationOffload:
    """The gradient-checkpointing function that keeps each layer's checkpoint in `pool`."""

    def __init__(self, pool: LockedPool, device: torch.device | str = "cpu") -> None:
        self.pool = pool
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stats = ActivationStats()
        self._saved: weakref.WeakValueDictionary[int, _Saved] = weakref.WeakValueDictionary()  # the live ones
        self._next = 0
        self._call = 0  # checkpointed layer calls so far
        self._by_call: dict[int, list[int]] = {}  # call -> the keys it offloaded (those still live)
        self._stream: Any = None  # the side stream, made on first use

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """What `model._set_gradient_checkpointing(gradient_checkpointing_func=...)` calls per layer."""
        kwargs.pop("use_reentrant", None)  # the reentrant variant saves no tensors through these hooks
        self._call += 1
        self._by_call = {c: keys for c, keys in self._by_call.items() if any(k in self._saved for k in keys)}
        with saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)

    # -- hooks ------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if not worth_offloading(tensor, self.device):
            self.stats.kept += 1
            return tensor  # autograd keeps it, as without these hooks
        key, self._next = self._next, self._next + 1
        saved = _Saved(self, key, self.pool.tensor(tensor.numel(), tensor.dtype), tensor, self._call)
        source = tensor.detach()
        if self._on_gpu:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is written by then
            with torch.cuda.stream(stream):
                saved.on_host().copy_(source, non_blocking=True)
                saved.stored = torch.cuda.Event()
                saved.stored.record(stream)
            source.record_stream(stream)  # the allocator must not reuse it before the copy is done
        else:
            saved.on_host().copy_(source)
        self._saved[key] = saved
        self._by_call.setdefault(self._call, []).append(key)
        nbytes = _nbytes(saved.host)
        s = self.stats
        s.live_bytes += nbytes
        s.live_peak_bytes = max(s.live_peak_bytes, s.live_bytes)
        s.offloaded_bytes += nbytes
        s.tensors += 1
        return saved

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed  # kept where it was
        saved: _Saved = packed
        if saved.handed is not None:
            return saved.handed
        if saved.freed:
            raise RuntimeError("an activation checkpoint was unpacked after drop() freed it (a backward through a "
                               "step that was abandoned)")
        self.stats.returned_bytes += _nbytes(saved.host)
        back, saved.back = saved.back, None
        if back is None:
            back = self._fetch(saved)
        else:
            self.stats.prefetched += 1
        self._release(saved)  # fenced by the copy back just queued
        if self._on_gpu:
            torch.cuda.current_stream(self.device).wait_event(saved.arrived)
        # Backward runs last layer first: the next tensors it needs are those the layer call before this one saved.
        for key in self._by_call.pop(saved.call - 1, ()):
            earlier = self._saved.get(key)
            if earlier is not None and earlier.back is None and not earlier.freed:
                earlier.back = self._fetch(earlier)
        saved.handed = back
        return back

    def _fetch(self, saved: _Saved) -> torch.Tensor:
        """Start the copy back to the compute device (its completion is `saved.arrived`)."""
        if not self._on_gpu:
            return saved.on_host().clone()
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            stream.wait_event(saved.stored)
            back = torch.empty_strided(saved.shape, saved.stride, dtype=saved.host.dtype, device=self.device)
            back.copy_(saved.on_host(), non_blocking=True)
            saved.arrived = torch.cuda.Event()
            saved.arrived.record(stream)
        back.record_stream(torch.cuda.current_stream(self.device))
        return back

    @property
    def _on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _release(self, saved: _Saved) -> None:
        """The host buffer back to the pool, fenced by the side stream's copies (to the host and back)."""
        saved.freed = True
        self.stats.live_bytes -= _nbytes(saved.host)
        self.pool.free(saved.host, streams=(self._stream,) if self._stream is not None else ())

    def drop(self) -> int:
        """Free every checkpoint autograd still holds (a forward whose loss was not backpropagated, or a step that
        failed between them); the number dropped. Safe between steps, a no-op after a backward."""
        live = [saved for saved in list(self._saved.values()) if not saved.freed]
        for saved in live:
            saved.back = None
            self._release(saved)
        for saved in list(self._saved.values()):
            saved.back = saved.handed = None  # the device copies are autograd's to hold, not this offload's
        self._saved.clear()
        self._by_call.clear()
        return len(live)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
