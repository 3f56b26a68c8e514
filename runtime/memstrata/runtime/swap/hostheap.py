"""The host heap every run gets: big blocks in their own mappings, backed by huge pages, and freed pages returned.

A fixed mmap threshold (`bound_host_heap`) keeps the host's peak to the tensors the planner counts, but every
fresh mapping then faults its pages in one 4 KiB page at a time, every step: measured 20% more forward and
backward time on the CPU. Asking for transparent huge pages on those mappings (torch's own allocator does it when
THP_MEM_ALLOC_ENABLE is set, for blocks of 2 MiB and more) faults them in 2 MiB at a time: gpt-125m's all-DRAM
step went from 1.01 s to 0.80 s at the same peak (benchmarks/offload/run.py's all-fits run).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["bound_host_heap", "huge_page_tensors", "release_free_heap", "HEAP_MMAP_THRESHOLD"]

log = logging.getLogger(__name__)

# glibc's mallopt parameter numbers; the size from which every allocation gets its own mapping, and the free
# space the heap's top keeps rather than giving back to the kernel at each free.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_MMAP_THRESHOLD = 1 << 20
HEAP_TRIM_THRESHOLD = 64 << 20
# torch (c10/core/impl/alloc_cpu.cpp) reads it once, at the process's first CPU allocation, and then madvises
# every CPU block of 2 MiB or more MADV_HUGEPAGE. A user's explicit 0 is kept.
THP_ENV = "THP_MEM_ALLOC_ENABLE"
# A block torch advises: 4 MiB always holds an aligned 2 MiB page.
_PROBE_BYTES = 4 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _glibc(name: str) -> Any:
    """glibc's function `name` from this process's own symbols, or None where there is no glibc."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return malloc's free pages to the kernel (glibc `malloc_trim(0)`; a no-op elsewhere).

    Blocks under the mmap threshold come from the heap, and what they free stays resident until trimmed: up to
    HEAP_TRIM_THRESHOLD at the heap's top under `bound_host_heap`, and more where something freed below it."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


def bound_host_heap() -> bool:
    """Serve every host allocation of HEAP_MMAP_THRESHOLD bytes or more from its own mapping, unmapped when freed
    (glibc `mallopt(M_MMAP_THRESHOLD)`), and ask torch to back those of 2 MiB or more with huge pages. True where
    the threshold was set (False: no glibc). Call it before the process's first tensor: torch reads THP_ENV then.

    glibc's default moves the threshold up to the largest block freed so far (at most 32 MiB), after which a
    layer's activations of a few MiB come from the heap, and the holes they leave stay resident: SmolLM2-135M at
    4 x 1024 tokens held 1.1 GiB above its saved tensors (4.8 GiB for 3.7), which no plan can count. A fixed
    threshold makes the host's peak the tensors the planner counts (memstrata.plan.accounting.activation_bytes);
    the huge pages take back most of the page faults it costs.

    Setting it also pins glibc's trim threshold at its default, 128 KiB: the heap's top, where a layer's smaller
    blocks (under 1 MiB) come and go, was then given back and faulted in again at every free, 7% of gpt-125m's
    all-DRAM step. HEAP_TRIM_THRESHOLD keeps up to 64 MiB of it (what the heap held a moment before, not more),
    and the update's `release_free_heap` still returns all of it once a step."""
    os.environ.setdefault(THP_ENV, "1")
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                   HEAP_TRIM_THRESHOLD))


def advised_huge(smaps: str, address: int) -> bool | None:
    """Whether the mapping holding `address`, in the text of a /proc/PID/smaps, is advised huge pages (its
    VmFlags carry `hg`); None where no mapping holds it."""
    inside = False
    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            start, _, end = head.partition("-")
            inside = int(start, 16) <= address < int(end, 16)
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return None


def thp_mode(setting: str) -> str:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled ('always [madvise] never')."""
    return next((w.strip("[]") for w in setting.split() if w.startswith("[")), "")


def thp_offered() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks (THP 'always' or 'madvise')."""
    try:
        return thp_mode(THP_SETTING.read_text()) in ("always", "madvise")
    except OSError:
        return False


def huge_page_tensors() -> bool | None:
    """Whether a CPU tensor torch allocates now is advised huge pages: None where the kernel offers none (THP
    'never' or absent), False where torch allocated before THP_ENV was set (or a user set it to 0)."""
    if not thp_offered():
        return None
    import torch

    probe = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
    return bool(advised_huge(Path("/proc/self/smaps").read_text(), probe.data_ptr()))


def warn_without_huge_pages() -> bool | None:
    """`huge_page_tensors`, logging a warning that says what to do where it is False: the run's forward and
    backward then pay a page fault per 4 KiB of every fresh block."""
    advised = huge_page_tensors()
    if advised is False and os.environ.get(THP_ENV) != "0":
        log.warning("host tensors get no huge pages: torch allocated a tensor before memstrata set %s=1, so "
                    "forward and backward run up to 25%% slower on the CPU; open the engine "
                    "(memstrata.runtime.swap.integration.open_layer) before building the model, or start the "
                    "process with %s=1", THP_ENV, THP_ENV)
    return advised
