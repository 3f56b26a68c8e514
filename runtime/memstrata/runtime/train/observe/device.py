"""The compute device as the run reports it: its memory peak, and phase times that are the device's, not the host's.

A GPU runs what the host queues asynchronously: a clock read right after `engine(...)` returns measures how long
the host took to queue the forward, and the forward's real time lands in whichever phase next waits for the
device. `PhaseClock` synchronizes the device before each reading, so forward, backward and step are each the time
the device spent on them. On the CPU synchronizing is nothing.

The HBM peak is what the process held on the device, not only what its tensors held: torch's caching allocator
keeps what it reserved (`max_memory_reserved`, not `max_memory_allocated`), and the CUDA context, cuBLAS's
workspaces and NCCL's buffers live outside that allocator altogether.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["PhaseClock", "hbm_peak_bytes", "synchronizer"]


def synchronizer(device: Any) -> Callable[[], None]:
    """What waits for everything queued on `device` (a no-op for the CPU)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.synchronize(device)


class PhaseClock:
    """Seconds between marks, each taken once the device has finished what was queued before it."""

    def __init__(self, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self.sync, self.clock = sync, clock
        self.last = 0.0

    def start(self) -> float:
        self.sync()
        self.last = self.clock()
        return self.last

    def lap(self) -> float:
        """Seconds since the previous mark."""
        self.sync()
        now = self.clock()
        elapsed, self.last = now - self.last, now
        return elapsed


def hbm_peak_bytes(device: Any) -> int:
    """The most device memory this process has held: torch's reserved peak plus what lives outside torch's
    allocator (the device's used memory less what torch reserves now; one rank per GPU, so nothing else is on it).
    0 on the CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return int(torch.cuda.max_memory_reserved(device) + outside)


def hbm_in_use(device: Any) -> int | None:
    """Device memory torch holds for tensors now (None on the CPU: there is no HBM stratum)."""
    import torch

    device = torch.device(device)
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
