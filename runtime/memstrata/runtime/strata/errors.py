"""The one exception family of memstrata.runtime's native layer.

Every failure of the raw-NVMe engine, the NUMA and pinned arenas and the
overflow check is a `StrataError`, so a caller can catch the whole layer in
one place; each subclass carries the facts a user needs to act (the device,
the byte range, the errno, the NUMA node, the memlock numbers).
"""
from __future__ import annotations

import errno as errno_names
import os
from collections.abc import Callable

from memstrata.node.safety import DeviceUnsafeError


class StrataError(Exception):
    """Base of every error raised by memstrata.runtime's native layer."""


class NvmeError(StrataError):
    """An I/O, allocation or open failure on one device of the NVMe engine."""

    def __init__(
        self,
        reason: str,
        *,
        device: str,
        offset: int | None = None,
        length: int | None = None,
        errno: int | None = None,
    ) -> None:
        self.reason = reason
        self.device = device
        self.offset = offset
        self.length = length
        self.errno = errno
        where = device
        if offset is not None:
            where += f" at offset {offset}"
        if length is not None:
            where += f" length {length}"
        err = ""
        if errno is not None:
            name = errno_names.errorcode.get(errno, str(errno))
            err = f" [{name}: {os.strerror(errno)}]"
        super().__init__(f"{where}: {reason}{err}")


class DeviceRefusedError(NvmeError, DeviceUnsafeError):
    """The engine refused a device under the namespace-safety rule (memstrata.node.safety): an
    NvmeError like every engine failure, and the rule's own DeviceUnsafeError."""

    def __init__(self, unsafe: DeviceUnsafeError) -> None:
        # Both bases' constructors chain through super() and want other arguments: set what each
        # promises (device, reason, offset, length, errno) and the rule's message directly.
        self.device, self.reason = unsafe.device, unsafe.reason
        self.offset = self.length = self.errno = None
        Exception.__init__(self, str(unsafe))

    def __reduce__(self) -> tuple[Callable[..., DeviceUnsafeError], tuple[object, ...]]:
        return DeviceRefusedError, (DeviceUnsafeError(self.device, self.reason),)


class NumaError(StrataError):
    """A NUMA placement that cannot be honoured (missing node, mbind failure)."""

    def __init__(self, message: str, *, nodes: tuple[int, ...] = (), errno: int | None = None) -> None:
        self.nodes = nodes
        self.errno = errno
        super().__init__(message)


class PinnedMemoryError(StrataError):
    """Page-locking failed; carries the bytes needed against RLIMIT_MEMLOCK."""

    def __init__(
        self, message: str, *, needed_bytes: int, limit_bytes: int | None, errno: int | None = None
    ) -> None:
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes
        self.errno = errno
        super().__init__(message)
