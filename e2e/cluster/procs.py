"""The processes the e2e peers run: ports to give them, and how they are stopped (their whole group) and tied to
the test process (killed with it)."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess

_handed_out: set[int] = set()


def free_port() -> int:
    # The port is released before the server binds it; a clash with another
    # program is possible but rare, and start() then fails loudly. Ports
    # already handed out in this process are never repeated.
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL it after grace_s, and reap it."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
    proc.wait()


def die_with_parent() -> None:
    # Runs in the child before exec: if the test process is killed outright
    # (no finalizers run), the kernel kills the component too, so nothing is
    # left holding ports. PR_SET_PDEATHSIG = 1.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
