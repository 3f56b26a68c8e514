"""Exact-size page-locked arena with buffer sets per tensor-shape class.

DeepSpeed pins `buffer_count` buffers all sized for the largest tensor, and
torch's pinned allocator rounds each request up to a power of two. Here one
region per stratum is carved exactly (4 KiB alignment, nothing rounded to a
power of two) into one buffer set per shape class (embedding/LM head,
attention projections, MLP projections, the rest), each sized for the
largest tensor *of its class*. The region is registered with
cudaHostRegister when CUDA is present (so copies are truly pinned), mlock'ed
otherwise; locked bytes are accounted, and a too-low RLIMIT_MEMLOCK is
reported with the number needed.
"""
from __future__ import annotations

import ctypes
import errno as E
import resource
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from memstrata.runtime import _native
from memstrata.runtime.strata.errors import PinnedMemoryError

__all__ = ["ShapeClass", "BufferSet", "PinnedArena", "PinnedMemoryError", "shape_class", "buffer_sets_for",
           "layout", "locked_bytes_total", "vm_locked_bytes"]

ALIGN = 4096
_locked_total = 0  # bytes locked by every live arena of this process


class ShapeClass(str, Enum):
    EMBEDDING = "embedding"  # token embedding and LM head: the largest tensors
    ATTENTION = "attention"  # q/k/v/o projections
    MLP = "mlp"  # gate/up/down projections
    OTHER = "other"  # norms, biases


_MARKERS = [
    # memstrata's own Decoder names its untied LM head `head` and its position table `positions`.
    (ShapeClass.EMBEDDING, ("embed", "lm_head", "wte", "wpe", "word_embeddings", "output.weight", "positions")),
    (ShapeClass.ATTENTION, ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj", "query_key_value")),
    (ShapeClass.MLP, ("mlp", "gate_proj", "up_proj", "down_proj", "fc1", "fc2", "c_fc", "feed_forward")),
]


def shape_class(param_name: str) -> ShapeClass:
    """The shape class of a parameter from its module path (HF/GPT naming)."""
    name = param_name.lower()
    if name.endswith("bias") or "norm" in name or "ln_" in name:
        return ShapeClass.OTHER
    if name == "head.weight" or name.endswith(".head.weight"):
        return ShapeClass.EMBEDDING
    for cls, markers in _MARKERS:
        if any(m in name for m in markers):
            return cls
    return ShapeClass.OTHER


@dataclass(frozen=True)
class BufferSet:
    shape_class: ShapeClass
    buffer_bytes: int  # exact size of each buffer (before 4 KiB alignment of its start)
    count: int


def buffer_sets_for(numels: Mapping[str, int], *, dtype_bytes: int, count: int) -> list[BufferSet]:
    """Per shape class, up to `count` buffers the size of that class's largest tensor — never more
    buffers than the class has tensors (a model has one or two embedding-sized tensors, not `count`)."""
    largest: dict[ShapeClass, int] = {}
    tensors: dict[ShapeClass, int] = {}
    for name, numel in numels.items():
        cls = shape_class(name)
        largest[cls] = max(largest.get(cls, 0), numel * dtype_bytes)
        tensors[cls] = tensors.get(cls, 0) + 1
    return [BufferSet(cls, size, min(count, tensors[cls]))
            for cls, size in sorted(largest.items(), key=lambda kv: kv[0].value)]


def layout(sets: Sequence[BufferSet]) -> tuple[list[tuple[ShapeClass, int, int]], int]:
    """[(class, offset, nbytes)] for every buffer, and the arena size. Pure."""
    slots, offset = [], 0
    for s in sets:
        if s.buffer_bytes <= 0 or s.count <= 0:
            raise ValueError(f"buffer set {s.shape_class.value}: size and count must be positive, got {s}")
        for _ in range(s.count):
            slots.append((s.shape_class, offset, s.buffer_bytes))
            offset += -(-s.buffer_bytes // ALIGN) * ALIGN
    return slots, offset


def vm_locked_bytes(pid: str = "self") -> int:
    """VmLck of a process: what the kernel counts against RLIMIT_MEMLOCK."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    return 0


def locked_bytes_total() -> int:
    return _locked_total


def _cudart() -> Any | None:
    """libcudart when a CUDA device is usable, else None (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and not torch.cuda.is_available():
        return None
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        n = ctypes.c_int(0)
        if lib.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value > 0:
            return lib
        return None
    return None


def _lock_error(size: int, exc: OSError) -> PinnedMemoryError:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else soft
    already = vm_locked_bytes()
    needed = already + size
    if limit is not None and needed > limit:
        msg = (f"cannot lock {size} bytes of pinned arena: RLIMIT_MEMLOCK is {limit} bytes and {already} are "
               f"already locked; it must be at least {needed} bytes (ulimit -l {-(-needed // 1024)}, or "
               f"CAP_IPC_LOCK)")
    else:
        msg = f"cannot lock {size} bytes of pinned arena: {exc.strerror}"
    return PinnedMemoryError(msg, needed_bytes=needed, limit_bytes=limit, errno=exc.errno)


class PinnedArena:
    """One locked region carved into per-shape-class buffer sets."""

    def __init__(self, region: Any, slots: list[tuple[ShapeClass, int, int]], cudart: Any | None) -> None:
        self._region = region
        self._cudart = cudart
        self._free: dict[ShapeClass, list[int]] = {}
        self._slots = {off: (cls, n) for cls, off, n in slots}
        for cls, off, _ in slots:
            self._free.setdefault(cls, []).append(off)
        self._taken: set[int] = set()

    @classmethod
    def create(cls, sets: Sequence[BufferSet], *, use_cuda: bool | None = None) -> PinnedArena:
        """Map, lock (or cudaHostRegister) and carve the arena for `sets`."""
        global _locked_total
        slots, size = layout(sets)
        if size == 0:
            raise ValueError("a pinned arena needs at least one buffer set")
        cudart = _cudart() if use_cuda in (None, True) else None
        if use_cuda and cudart is None:
            raise PinnedMemoryError("use_cuda=True but no CUDA device is usable", needed_bytes=size,
                                    limit_bytes=None, errno=E.ENODEV)
        try:
            region = _native.Region(size)
        except OSError as exc:
            raise PinnedMemoryError(f"cannot map {size} bytes: {exc.strerror}", needed_bytes=size,
                                    limit_bytes=None, errno=exc.errno) from None
        try:
            if cudart is not None:
                rc = cudart.cudaHostRegister(ctypes.c_void_p(region.address), ctypes.c_size_t(size), 0)
                if rc != 0:
                    raise PinnedMemoryError(f"cudaHostRegister of {size} bytes failed with CUDA error {rc}",
                                            needed_bytes=size, limit_bytes=None)
            else:
                region.lock()
        except OSError as exc:
            region.close()
            raise _lock_error(size, exc) from None
        except BaseException:
            region.close()
            raise
        _locked_total += size
        return cls(region, slots, cudart)

    @property
    def nbytes(self) -> int:
        return int(self._region.size)

    @property
    def locked_bytes(self) -> int:
        return self.nbytes

    @property
    def cuda_registered(self) -> bool:
        return self._cudart is not None

    def buffer(self) -> memoryview:
        """The whole arena (register it with NvmeEngine.register_buffers)."""
        return memoryview(self._region)

    def acquire(self, cls: ShapeClass, nbytes: int | None = None) -> memoryview:
        """A free buffer of class `cls`, viewed as exactly `nbytes` (default: the buffer's size)."""
        free = self._free.get(cls)
        if free is None:
            raise KeyError(f"arena has no buffer set for shape class {cls.value!r}")
        if not free:
            raise PinnedMemoryError(f"all buffers of shape class {cls.value!r} are in use; release one first",
                                    needed_bytes=0, limit_bytes=None, errno=E.EBUSY)
        off = free[-1]
        size = self._slots[off][1]
        if nbytes is not None and not 0 < nbytes <= size:
            raise ValueError(f"{nbytes} bytes do not fit a {cls.value} buffer of {size} bytes")
        free.pop()
        self._taken.add(off)
        return memoryview(self._region)[off : off + (size if nbytes is None else nbytes)]

    def release(self, view: memoryview) -> None:
        """Give back a buffer obtained from acquire()."""
        off = _native.buffer_address(view)[0] - self._region.address
        if off not in self._taken:
            raise ValueError("buffer was not acquired from this arena (or released twice)")
        self._taken.discard(off)
        self._free[self._slots[off][0]].append(off)
        view.release()

    def close(self) -> None:
        global _locked_total
        if self._region.size == 0:
            return
        size = self.nbytes
        if self._region.exports:
            raise BufferError(f"cannot close pinned arena: {self._region.exports} views of it are alive")
        if self._cudart is not None:
            self._cudart.cudaHostUnregister(ctypes.c_void_p(self._region.address))
        self._region.close()  # munmap drops the mlock
        _locked_total -= size

    def __enter__(self) -> PinnedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
