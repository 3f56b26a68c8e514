"""A real seccomp filter for child processes: the kernel refuses io_uring exactly as a pod's
RuntimeDefault profile does (containerd 2.x and Docker 25+ answer EPERM, podman ENOSYS), without
touching the host-wide kernel.io_uring_disabled that other processes on this machine share."""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import struct
from collections.abc import Callable, Sequence

IO_URING_SETUP, IO_URING_ENTER, IO_URING_REGISTER = 425, 426, 427  # the same on every 64-bit arch
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_PR_CAPBSET_DROP, _CAP_IPC_LOCK = 24, 14
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_unsupported() -> str | None:
    if platform.machine() not in _AUDIT_ARCH:
        return f"no seccomp test filter for {platform.machine()}"
    if not os.path.exists("/proc/self/status") or "Seccomp:" not in open("/proc/self/status").read():
        return "this kernel has no seccomp"
    return None


def _program(deny: Sequence[int], err: int) -> bytes:
    """BPF: on this arch, syscall numbers in `deny` return -err; everything else is allowed."""
    allow = 3 + len(deny)
    ins = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 0, allow - 2, _AUDIT_ARCH[platform.machine()]), (_LD_W_ABS, 0, 0, 0)]
    ins += [(_JEQ_K, allow + 1 - (3 + i) - 1, 0, nr) for i, nr in enumerate(deny)]
    ins += [(_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_ERRNO | err)]
    return b"".join(struct.pack("HBBI", *i) for i in ins)


def _submissions_program(err: int) -> bytes:
    """BPF: io_uring_enter with to_submit (its 2nd argument) != 0 returns -err; all else is allowed."""
    ins = [
        (_LD_W_ABS, 0, 0, 4), (_JEQ_K, 0, 5, _AUDIT_ARCH[platform.machine()]),  # another arch: allow
        (_LD_W_ABS, 0, 0, 0), (_JEQ_K, 0, 3, IO_URING_ENTER),  # another syscall: allow
        (_LD_W_ABS, 0, 0, 24), (_JEQ_K, 1, 0, 0),  # args[1] (low word, little-endian): 0 = a pure wait, allowed
        (_RET_K, 0, 0, _RET_ERRNO | err), (_RET_K, 0, 0, _RET_ALLOW),
    ]
    return b"".join(struct.pack("HBBI", *i) for i in ins)


def _prctl(*args: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(*args) != 0:
        raise OSError(ctypes.get_errno(), f"prctl{args[:2]}")


def deny_syscalls(deny: Sequence[int], err: int) -> None:
    """Install the filter on this process (and, through exec, its children); it cannot be removed."""
    code = _program(deny, err)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)


def refuse_io_uring_submissions(err: int) -> None:
    """On the calling thread only (and threads it starts later): every io_uring_enter that submits
    SQEs fails with `err` and takes none, as the kernel's own EAGAIN or ENOMEM when it cannot
    allocate requests; pure waits still pass. The filter ends with the thread."""
    if platform.machine() not in _AUDIT_ARCH or struct.pack("=I", 1)[0] != 1:
        raise OSError(errno.ENOSYS, f"no io_uring submission filter for {platform.machine()}")
    code = _submissions_program(err)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # prctl acts on the calling thread alone (no TSYNC)
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)


def preexec(*, deny: Sequence[int] = (), err: int = 1, memlock: int | None = None,
            drop_ipc_lock: bool = False) -> Callable[[], None]:
    """A subprocess preexec_fn: like a pod, optionally with io_uring refused, the runtime's memlock
    limit and no CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK through it)."""
    def run() -> None:
        if drop_ipc_lock and os.geteuid() == 0:
            _prctl(_PR_CAPBSET_DROP, _CAP_IPC_LOCK, 0, 0, 0)
        if memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))
        if deny:
            deny_syscalls(deny, err)
    return run
