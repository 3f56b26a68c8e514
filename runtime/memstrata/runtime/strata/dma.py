"""The device that copies to and from the locked pools by DMA: registration, and fences on reuse.

An mlock'ed page that the GPU's driver does not know is copied through a staging buffer of the driver's,
synchronously, whatever `non_blocking` says; only registered memory (cudaHostRegister) is copied by the
GPU's own DMA engines while the host goes on. Once a region is registered, a `non_blocking` copy returns
before it has read (or written) its host buffer, so a buffer given back to its pool must not be handed out
again until every copy queued on it has run. torch's caching host allocator keeps that rule with an event
recorded at each copy; it also rounds every block up to a power of two and never gives memory back, which is
why the swap layer keeps its own pools (memstrata.runtime.strata.pinned) and this module gives them the rule:
`LockedPool.free` takes a `Fence` (an event on the current stream and on each stream the caller names: the
ones its copies were queued on), and the space is reused only once the fence has passed.

`dma_device(device)` is the one place that decides: a CUDA device gets a `CudaDma`; anything else none (the
CPU copies synchronously, nothing to register or fence). Tests give a pool their own `DmaDevice` to count
registrations and hold fences open on a machine without a GPU.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from memstrata.runtime.strata.buffers import torch_module
from memstrata.runtime.strata.errors import PinnedMemoryError

__all__ = ["CudaDma", "DmaDevice", "Fence", "dma_device"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class Fence(Protocol):
    """The point in a device's queues after which no copy queued before it still touches a buffer."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class DmaDevice(Protocol):
    """What a locked pool needs of the device that copies its buffers."""

    name: str

    def register(self, address: int, size: int) -> None: ...

    def unregister(self, address: int) -> None: ...

    def fence(self, streams: Sequence[Any] = ()) -> Fence: ...

    def current_stream(self) -> Any: ...


class _Events:
    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def done(self) -> bool:
        return all(e.query() for e in self.events)

    def wait(self) -> None:
        for e in self.events:
            e.synchronize()


class CudaDma:
    """A CUDA device: regions registered with cudaHostRegister, fences made of CUDA events."""

    def __init__(self, device: Any) -> None:
        torch = torch_module()
        self.device = torch.device(device)
        self.name = str(self.device)

    def register(self, address: int, size: int) -> None:
        # Portable: pinned for every CUDA context of the process, whichever device is current when a pool grows.
        err = int(torch_module().cuda.cudart().cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE))
        if err != 0:
            raise PinnedMemoryError(f"cannot register {size} bytes of a locked pool with {self.name} "
                                    f"(cudaHostRegister error {err})", needed_bytes=size, limit_bytes=None, errno=0)

    def unregister(self, address: int) -> None:
        # An error here (a context already torn down at exit) leaves nothing to undo: the region is unmapped next.
        torch_module().cuda.cudart().cudaHostUnregister(address)

    def current_stream(self) -> Any:
        return torch_module().cuda.current_stream(self.device)

    def fence(self, streams: Sequence[Any] = ()) -> Fence:
        torch = torch_module()
        events = []
        for stream in (torch.cuda.current_stream(self.device), *streams):
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return _Events(events)


def dma_device(device: Any) -> DmaDevice | None:
    """The DMA device of a compute device: a CUDA one for CUDA, None for the CPU (and anything else)."""
    if device is None:
        return None
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    return CudaDma(device) if str(kind).split(":")[0] == "cuda" else None
