"""Zero-copy byte views of the buffers the native layer accepts.

bytes/bytearray/mmap/memoryview/numpy arrays go through the buffer protocol;
CPU torch tensors (which do not implement it) are reinterpreted as uint8
numpy arrays over the same storage. torch is imported only by `torch_module`,
on first use: a tensor can only exist if the caller already imported it.
"""
from __future__ import annotations

import sys
from typing import Any


def torch_module() -> Any:
    """torch, imported on first use only: the strata work without it (the QEMU guest has none)."""
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: F811
    return torch


def is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_byte_view(obj: Any, *, writable: bool, what: str = "buffer") -> memoryview:
    """A 1-D unsigned-byte memoryview over `obj`'s memory (no copy)."""
    if is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(f"{what} is a tensor on {obj.device}; stage it through a host buffer")
        if not obj.is_contiguous():
            raise ValueError(f"{what} is a non-contiguous tensor; pass .contiguous()")
        obj = obj.detach().reshape(-1).view(sys.modules["torch"].uint8).numpy()
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} of type {type(obj).__name__} does not expose its memory") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous")
    if writable and mv.readonly:
        raise ValueError(f"{what} is read-only but must receive data")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv
