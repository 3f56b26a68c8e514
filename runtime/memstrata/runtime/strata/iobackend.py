"""Which kernel interface moves the raw-NVMe engine's bytes: io_uring, or pread/pwrite threads.

io_uring is the fast path, and often refused in a pod: containerd 2.x and Docker 25+ dropped
io_uring_setup/enter/register from their RuntimeDefault seccomp profiles (the call fails with
EPERM; podman's answers ENOSYS), `kernel.io_uring_disabled` switches it off node-wide, an LSM can
deny it (EACCES), and kernels before 5.12 charge the ring to RLIMIT_MEMLOCK (ENOMEM). None of
that may stop a job, so `open_queue` falls back to `_native.Threads` — the same submit/wait
interface over worker threads doing pread/pwrite on the same O_DIRECT descriptors — and logs one
warning per cause naming it. On these machines plain pread/pwrite reached ~2.4/1.8 GiB/s against
io_uring's 2.5-3.0/2.0 on the same loop device, so the fallback costs little.

`MEMSTRATA_IO_BACKEND` (or the engine's `io_backend` argument) picks: `auto` (the default: io_uring,
else threads), `io_uring` (no fallback: a refusal is an error, for benchmarks that must measure
io_uring), `threads` (never try io_uring).
"""
from __future__ import annotations

import errno as E
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memstrata.runtime import _native
from memstrata.runtime.strata.errors import NvmeError

__all__ = ["BACKENDS", "ENV_IO_BACKEND", "OpenedQueue", "choose_backend", "open_queue", "refusal_cause",
           "register_fixed"]

ENV_IO_BACKEND = "MEMSTRATA_IO_BACKEND"
BACKENDS = ("auto", "io_uring", "threads")
THREAD_PATH = "the pread/pwrite thread path"

log = logging.getLogger(__name__)
_warned: set[str] = set()  # causes already logged by this process: one line each, not one per engine

# Why the kernel says no, by errno: what an operator reading the pod's log can act on.
_CAUSES = {
    E.EPERM: "the container's seccomp profile (containerd's and Docker's RuntimeDefault deny io_uring) or "
             "sysctl kernel.io_uring_disabled",
    E.ENOSYS: "the kernel has no io_uring (before 5.1, or built without it), or a seccomp profile that answers "
              "ENOSYS",
    E.EACCES: "a security module (SELinux, AppArmor) denies io_uring",
    E.ENOMEM: "the ring does not fit under RLIMIT_MEMLOCK (kernels before 5.12 charge it there)",
}


@dataclass(frozen=True)
class OpenedQueue:
    queue: Any  # _native.Ring or _native.Threads: submit / wait / register_buffers / close, bounded waits
    backend: str  # "io_uring" | "threads"
    fallback: str | None  # why io_uring is not used (None when it is, or when threads were asked for)


def choose_backend(requested: str | None = None) -> str:
    """The argument if given, else $MEMSTRATA_IO_BACKEND, else auto. Raises ValueError naming the source."""
    source, value = ("io_backend", requested) if requested is not None else \
        (f"${ENV_IO_BACKEND}", os.environ.get(ENV_IO_BACKEND, "").strip() or "auto")
    if value not in BACKENDS:
        raise ValueError(f"{source}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def refusal_cause(exc: OSError) -> str:
    """One phrase: which call failed, the errno's name, and what on the node makes it fail."""
    code = exc.errno if exc.errno is not None else 0
    name = E.errorcode.get(code, str(code))
    call = str(exc.strerror or "").split(":", 1)[0] or "io_uring setup"
    why = _CAUSES.get(code)
    if why is None:
        return f"io_uring setup failed ({call}: {name}, {os.strerror(code)})"
    return f"io_uring refused by the kernel ({call}: {name}: {why})"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("memstrata: %s", message)


def open_queue(depth: int, fds: Sequence[int], *, device: str, backend: str | None = None,
               timeout_s: float = 60.0) -> OpenedQueue:
    """The engine's I/O queue over `fds`; never fails only because io_uring is refused, unless asked to.

    `timeout_s`: a wait (or close) that sees no completion for this long fails with TimeoutError."""
    choice = choose_backend(backend)
    if choice != "threads":
        try:
            return OpenedQueue(_native.Ring(depth, list(fds), timeout_s=timeout_s), "io_uring", None)
        except OSError as exc:
            if choice == "io_uring":
                raise NvmeError(f"cannot set up io_uring ({ENV_IO_BACKEND}=io_uring allows no fallback): "
                                f"{refusal_cause(exc)}", device=device, errno=exc.errno) from None
            fallback: str | None = refusal_cause(exc)
    else:
        fallback = None
    try:
        queue = _native.Threads(depth, list(fds), timeout_s=timeout_s)
    except OSError as exc:
        raise NvmeError(f"cannot start the I/O threads: {exc.strerror}", device=device, errno=exc.errno) from None
    if fallback is not None:
        _warn_once(f"{fallback}; using {THREAD_PATH} (O_DIRECT, {queue.depth} threads) for the NVMe stratum")
    return OpenedQueue(queue, "threads", fallback)


def register_fixed(queue: Any, views: Sequence[memoryview], *, device: str) -> bool:
    """Register `views` as io_uring fixed buffers; False (and one warning) where the kernel refuses.

    Fixed buffers only save the per-op page pinning, so a refusal never stops the engine: registered
    memory counts against RLIMIT_MEMLOCK for a process without CAP_IPC_LOCK (ENOMEM, the usual case
    in a pod), and a seccomp profile may allow io_uring_setup but not io_uring_register (EPERM)."""
    try:
        queue.register_buffers(list(views))
    except OSError as exc:
        code = exc.errno if exc.errno is not None else 0
        why = ("registered buffers count against RLIMIT_MEMLOCK without CAP_IPC_LOCK" if code == E.ENOMEM
               else _CAUSES.get(code, os.strerror(code)))
        _warn_once(f"io_uring cannot register fixed buffers ({E.errorcode.get(code, code)}: {why}; first on "
                   f"{device}); I/O goes on with per-op page pinning")
        return False
    return True
