"""The host buffers DeepSpeed pins, served exactly from the swap layer's pools.

With `pin_memory` on, ZeRO-3 page-locks, through its accelerator's `pin_memory` (torch's caching host
allocator on a GPU):
- every 16-bit weight partition it keeps in host memory (`Init._partition_param`, `_partition_param_sec`),
- the fp16 flat buffer of CPU-offloaded weights (`_create_param_groups_fp16_flat_cpu_memory`),
- the flat gradient buffer, and the fp32 gradient buffer of every sub-group kept in host memory.
torch's allocator rounds each request up to a power of two and never gives a block back (Llama-3-8B's bf16
gradients: 16.1 GB asked, 17.2 GB pinned; 70B: 141 GB asked, 275 GB pinned), so freeing one of them frees
nothing, and it pins in DRAM what the plan put on CXL. While memstrata's layer constructs the model and the
engine (`pins_served`), the accelerator's `pin_memory` hands out buffers of exactly the asked size from the
layer's pools instead: the weights where the plan put them (`SwapSettings.weights_on_cxl`), everything else
(the operands of the CPU optimizer) bound to DRAM; on a GPU the pools are registered with it, so these
buffers are as pinned as torch's. memstrata's engine turns `pin_memory` on on the CPU too: there nothing
else could pin, and the pools serve every pin the same way, so a CPU test sees what a GPU run gets.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memstrata.runtime.strata.pinned import LockedPool

__all__ = ["WEIGHT_PINNERS", "Pins", "pins_served"]

# The DeepSpeed functions whose pins are 16-bit weights (declared in memstrata.runtime.swap.seam); every other
# pin is an operand of the CPU optimizer (the flat gradient buffer, a resident sub-group's fp32 gradient).
WEIGHT_PINNERS = frozenset({"_partition_param", "_partition_param_sec", "_create_param_groups_fp16_flat_cpu_memory"})


class Pins:
    """The accelerator's pin_memory/unpin_memory over two exact pools.

    DeepSpeed never unpins most of what it pins, it just drops it: with the weights in DRAM, ZeRO-3 copies every
    partition zero.Init pinned into one pinned flat buffer and lets the partitions go. torch's allocator would
    keep their blocks for good; here each served buffer is watched (a weak reference to its storage) and goes
    back to its pool once nothing holds it (`reap`, at every pin and when construction ends)."""

    def __init__(self, weights: LockedPool, operands: LockedPool) -> None:
        self.weights, self.operands = weights, operands
        self._held: dict[int, tuple[StorageWeakRef, LockedPool]] = {}  # address -> (its storage, its pool)

    def pin(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """`accelerator.pin_memory`: a copy of `tensor` (or, without `make_copy`, an empty buffer of its shape and
        dtype) in locked memory of exactly its size, from the pool its caller's kind of data belongs in."""
        frame = inspect.currentframe()
        caller = frame.f_back.f_code.co_name if frame is not None and frame.f_back is not None else ""
        pool = self.weights if caller in WEIGHT_PINNERS else self.operands
        self.reap()
        shape = tensor.shape if match_shape else torch.Size((tensor.numel(),))
        out = pool.tensor(tensor.numel(), tensor.dtype)
        out.set_(out.untyped_storage(), 0, shape)  # shaped in place: a view would keep its base alive (pinned.py)
        if make_copy:
            out.copy_(tensor.reshape(shape))
        storage = out.untyped_storage()
        self._held[storage.data_ptr()] = (StorageWeakRef(storage), pool)
        return out

    def reap(self) -> int:
        """Give back every served buffer nothing holds any more; how many."""
        gone = [(address, pool) for address, (ref, pool) in self._held.items() if ref.expired()]
        for address, pool in gone:
            del self._held[address]
            pool.free(address)
        return len(gone)

    def owner(self, tensor: torch.Tensor) -> LockedPool | None:
        return next((pool for pool in (self.weights, self.operands) if pool.owns(tensor)), None)

    def unpin(self, tensor: torch.Tensor) -> bool:
        """Give a served buffer back to its pool (what ZeRO-3 calls at teardown, and memstrata when it drops a
        buffer it does not need); False for a tensor these pools did not serve."""
        pool = self.owner(tensor)
        if pool is None:
            return False
        self._held.pop(tensor.untyped_storage().data_ptr(), None)
        pool.free(tensor)
        return True


@contextlib.contextmanager
def pins_served(pins: Pins) -> Iterator[Pins]:
    """While inside, DeepSpeed's accelerator pins through `pins` (its instance's methods, restored after)."""
    from deepspeed.accelerator import get_accelerator

    accelerator: Any = get_accelerator()
    before = {name: accelerator.__dict__.get(name) for name in ("pin_memory", "unpin_memory")}
    accelerator.pin_memory, accelerator.unpin_memory = pins.pin, pins.unpin
    try:
        yield pins
    finally:
        pins.reap()  # what construction pinned and dropped, then the regions that leaves idle
        pins.weights.trim()
        pins.operands.trim()
        for name, value in before.items():
            if value is None:
                accelerator.__dict__.pop(name, None)
            else:
                setattr(accelerator, name, value)
