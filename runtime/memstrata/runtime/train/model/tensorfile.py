"""safetensors files read with plain reads, never memory-mapped.

A mapped file that shrinks under the reader (a model copy cut short, a volume that goes away) kills the
process with SIGBUS on the next page it touches: no message, no cleanup, the scratch directory left behind.
Read with `pread` into memory the reader owns, the same event is a short read, which fails naming the file.
The header is checked against the file's size before a tensor is read, so a file that was already cut short
fails before loading starts.

Layout (the format's spec): an 8-byte little-endian header length, a JSON header mapping each tensor's
name to its dtype, shape and [begin, end) byte offsets into the data that follows, then the data.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "TensorFileError", "TensorFile"]

# safetensors' names for torch dtypes, and their sizes in bytes.
DTYPE_NAMES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float64": "F64",
               "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8",
               "torch.uint8": "U8", "torch.bool": "BOOL"}
_TORCH_NAMES = {name: torch_name for torch_name, name in DTYPE_NAMES.items()}
_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 << 20  # the reference implementation's own limit


class TensorFileError(ValueError):
    """A safetensors file cannot be read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class TensorFile:
    """One safetensors file open for reading: `keys()`, then `get_tensor(name)` per tensor (a context manager,
    like safetensors' `safe_open`, whose calls it answers)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._entries: dict[str, _Entry] = {}
        self._data = 0  # where the data starts

    def __enter__(self) -> TensorFile:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TensorFileError(f"{self.path}: missing") from None
        except OSError as exc:
            raise TensorFileError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read_header(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise TensorFileError(f"{self.path}: not a safetensors file: {size} bytes, shorter than its header")
        length = int.from_bytes(self._read(0, 8), "little")
        if length > min(_MAX_HEADER, size - 8):
            raise TensorFileError(f"{self.path}: not a safetensors file, or cut short: a header of {length} bytes "
                                  f"in a file of {size}")
        try:
            header = json.loads(self._read(8, length))
        except ValueError as exc:
            raise TensorFileError(f"{self.path}: not a safetensors file: its header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise TensorFileError(f"{self.path}: not a safetensors file: its header is not a JSON object")
        header.pop("__metadata__", None)
        self._data = 8 + length
        self._entries = {name: _entry(self.path, name, value) for name, value in header.items()}
        needed = self._data + max((e.end for e in self._entries.values()), default=0)
        if needed > size:
            raise TensorFileError(f"{self.path}: cut short: {size} bytes, its header describes {needed}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> "torch.Tensor":
        """The tensor `name`, read into memory of its own."""
        import torch

        entry = self._entries[name]
        dtype = getattr(torch, _TORCH_NAMES[entry.dtype].removeprefix("torch."))
        raw = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        if raw.numel():
            self._read_into(raw.numpy().data, self._data + entry.begin, name)
        return raw.view(dtype).reshape(entry.shape)

    def _read(self, offset: int, size: int) -> bytes:
        buffer = bytearray(size)
        self._read_into(memoryview(buffer), offset, "the header")
        return bytes(buffer)

    def _read_into(self, view: memoryview, offset: int, what: str) -> None:
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                raise TensorFileError(f"{self.path}: cannot read {what}: {exc.strerror or exc}") from None
            if got == 0:
                now = os.fstat(self._fd).st_size
                raise TensorFileError(f"{self.path}: truncated while being read: {what} needs bytes up to "
                                      f"{offset + len(view)}, the file now ends at {now}")
            done += got


def _entry(path: Path, name: str, value: object) -> _Entry:
    """One header entry, checked: a known dtype, a shape, and offsets that hold exactly that many bytes."""
    if not isinstance(value, dict):
        raise TensorFileError(f"{path}: {name}: not a tensor entry")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in _SIZES:
        raise TensorFileError(f"{path}: {name}: dtype {dtype!r} is not one memstrata reads "
                              f"({', '.join(_SIZES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise TensorFileError(f"{path}: {name}: shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise TensorFileError(f"{path}: {name}: data_offsets {offsets!r} are not [begin, end]")
    if offsets[1] - offsets[0] != math.prod(shape) * _SIZES[dtype]:
        raise TensorFileError(f"{path}: {name}: {offsets[1] - offsets[0]} bytes for a {dtype} tensor of shape "
                              f"{tuple(shape)}")
    return _Entry(dtype, tuple(shape), offsets[0], offsets[1])
