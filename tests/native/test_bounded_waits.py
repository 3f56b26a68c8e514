"""Every wait of the NVMe engine's I/O queues ends, with an error that says what is stuck.

A full CI run once hung for good in io_cqring_wait: the ring waited for the completion of an op
whose SQE the kernel had never taken (io_uring_enter takes fewer SQEs than offered when it fails
one while preparing it, and none when it cannot allocate requests), and nothing ever offered that
SQE again. These tests provoke both refusals for real, and completions that never come (an empty
pipe, a frozen filesystem), in child processes with their own time limit: a regression fails here
instead of hanging the session.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from native_helpers import child_env, need_tool, run

from memstrata.node.header import State, parse_header
from memstrata.node.safety import read_head
from memstrata.runtime.strata.errors import NvmeError
from memstrata.runtime.strata.nvme import NvmeEngine
from memstrata.runtime.strata.nvmeio import Handle

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
CHILD_LIMIT_S = 60  # each child needs a few seconds; a hung one is killed and the test fails


def _env() -> dict[str, str]:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])  # seccomp_helpers
    return env


def run_child(code: str, *args: str) -> dict:
    """Run `code` in a child Python and return the JSON object on its last stdout line."""
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                              timeout=CHILD_LIMIT_S, env=_env())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung for {CHILD_LIMIT_S} s (an unbounded wait): stdout {exc.stdout!r}, "
                    f"stderr {exc.stderr!r}")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _image(tmp_path: Path, pattern: bytes = b"memstrata") -> str:
    path = tmp_path / "ring.img"
    path.write_bytes((pattern * (MiB // len(pattern) + 1))[:MiB])
    return str(path)


SHORT_SUBMIT = """
    import ctypes, json, mmap, os, sys
    from memstrata.runtime import _native
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_DIRECT)
    ring = _native.Ring(2, [fd], **({} if sys.argv[2] == "auto" else {"wait_mode": sys.argv[2]}))
    good = mmap.mmap(-1, 4096)
    # No user buffer can live at a kernel address: the kernel fails such an SQE while preparing it
    # (its CQE says EFAULT) and, without IORING_SETUP_SUBMIT_ALL, takes none of the SQEs behind it.
    bad = (ctypes.c_char * 4096).from_address(0xFFFF800000000000)
    for tag in (1, 2, 3):
        ring.submit(False, 0, bad, 0, tag)
    ring.submit(False, 0, good, 0, 4)  # 1 and 2 fill the depth: 3 and 4 reach the kernel in one batch
    done = sorted(ring.wait(-1))
    print(json.dumps({"done": done, "queued": ring.queued, "data": good[:9].decode()}))
    ring.close()
"""


@pytest.mark.parametrize("wait_mode", ["auto", "poll"])
def test_sqes_the_kernel_left_in_the_ring_after_a_short_submit_still_complete(tmp_path: Path, wait_mode: str) -> None:
    """The hang itself: op 4's SQE stayed in the SQ ring after the kernel stopped at op 3's, and the
    ring waited in io_cqring_wait for a completion that could never come."""
    result = run_child(SHORT_SUBMIT, _image(tmp_path), wait_mode)
    assert result == {"done": [[1, -14], [2, -14], [3, -14], [4, 4096]], "queued": 0, "data": "memstrata"}, result


REFUSED = """
    import errno, json, mmap, os, sys, threading, time
    from seccomp_helpers import refuse_io_uring_submissions
    from memstrata.runtime import _native
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_DIRECT)
    ring = _native.Ring(4, [fd], timeout_s=1)
    buf = mmap.mmap(-1, 4096)
    out = {}

    def refused():  # on this thread the kernel takes no SQE, as when it cannot allocate requests
        refuse_io_uring_submissions(errno.EAGAIN)
        try:
            out["submit"] = ring.submit(False, 0, buf, 0, 7)
        except OSError as e:
            out["submit"] = f"OSError {e.errno}"
        out["in_kernel"], out["queued"] = getattr(ring, "in_kernel", None), ring.queued
        start = time.monotonic()
        try:
            out["wait"] = ring.wait(1)
        except OSError as e:
            out["wait"] = [e.errno, e.strerror, time.monotonic() - start]

    t = threading.Thread(target=refused)
    t.start()
    t.join()
    out["then"] = ring.wait(1)  # a thread the kernel serves: the SQE left in the ring goes in now
    out["data"] = buf[:9].decode()
    ring.close()
    print(json.dumps(out))
"""


def test_a_submission_the_kernel_refuses_is_offered_again_and_a_wait_on_it_ends(tmp_path: Path) -> None:
    """io_uring_enter answering EAGAIN used to raise from submit while the SQE stayed in the ring,
    counted in flight: the next wait (or close) slept for it forever."""
    result = run_child(REFUSED, _image(tmp_path))
    assert result["submit"] is False and result["in_kernel"] == 0 and result["queued"] == 1, result
    code, message, seconds = result["wait"]
    assert code == 110 and 1 <= seconds < 10, result  # ETIMEDOUT after the ring's 1 s, not never
    assert message == ("io_uring wait: no completion in 1.0 s with 1 ops in flight; 1 of them not taken by the "
                       "kernel, which refused them (Resource temporarily unavailable)"), message
    assert result["then"] == [[7, 4096]] and result["data"] == "memstrata", result


ENGINE_REFUSED = """
    import errno, json, sys, threading, time
    from seccomp_helpers import refuse_io_uring_submissions
    from memstrata.runtime.strata.errors import NvmeError
    from memstrata.runtime.strata.nvme import NvmeEngine
    eng = NvmeEngine.open([sys.argv[1]], job="t/refused", io_timeout_s=1)
    ext = eng.allocate(4096)
    out = {}

    def refused():
        refuse_io_uring_submissions(errno.EAGAIN)
        h = eng.write(ext, b"x" * 4096)
        try:
            eng.wait(h)
        except NvmeError as e:
            out["wait"] = [e.errno, e.device, str(e)]
        start = time.monotonic()
        try:
            eng.close()
        except NvmeError as e:
            out["close"] = [e.errno, time.monotonic() - start]

    t = threading.Thread(target=refused)
    t.start()
    t.join()
    print(json.dumps(out))
"""


def test_engine_wait_on_refused_io_names_device_operation_and_what_is_in_flight(tmp_path: Path) -> None:
    path = str(tmp_path / "dev.img")
    with open(path, "wb") as f:
        f.truncate(8 * MiB)
    result = run_child(ENGINE_REFUSED, path)
    code, device, message = result["wait"]
    assert code == 110 and device == path, result
    assert message.startswith(f"{path} at offset ") and "write of 4096 bytes did not complete: io_uring wait: " \
        "no completion in 1.0 s with 1 ops in flight; 1 of them not taken by the kernel" in message, message
    assert f"[io_uring; ops in flight: 1 on {path}] [ETIMEDOUT" in message, message
    code, seconds = result["close"]
    assert code == 110 and 1 <= seconds < 10, result  # the same timeout again, then close gives up: bounded
    header = parse_header(read_head(path, 4096))  # not drained: left OPEN for the node agent to scrub
    assert header is not None and header.state == State.OPEN, header


NEVER = """
    import json, os, signal, sys, time
    from memstrata.runtime import _native
    r, w = os.pipe()  # a read of an empty pipe completes only when someone writes
    ring = _native.Ring(1, [r], timeout_s=0.5, wait_mode=sys.argv[1])
    buf = bytearray(4096)
    out = {"mode": ring.wait_mode}
    ring.submit(False, 0, buf, 0, 1)
    signal.signal(signal.SIGALRM, lambda *_: None)  # signals that raise nothing neither end nor extend the wait
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    start = time.monotonic()
    try:
        out["wait"] = ring.wait(1)
    except TimeoutError as e:
        out["wait"] = [e.strerror, time.monotonic() - start, ring.in_kernel, ring.queued]
    signal.setitimer(signal.ITIMER_REAL, 0)
    os.write(w, b"z" * 4096)  # the completion comes after all: nothing was lost by the timeout
    out["late"] = ring.wait(1)
    ring.submit(False, 0, buf, 0, 2)
    start = time.monotonic()
    try:
        ring.close(timeout_s=0.3)
    except TimeoutError as e:
        out["close"] = [e.strerror, time.monotonic() - start]
    ring.close()  # closed already: nothing left to wait for
    try:
        ring.wait(1)
    except ValueError as e:
        out["closed"] = str(e)
    print(json.dumps(out))
"""


@pytest.mark.parametrize("wait_mode", ["auto", "poll"])
def test_a_completion_that_never_comes_fails_wait_and_close_instead_of_hanging(wait_mode: str) -> None:
    result = run_child(NEVER, wait_mode)
    assert result["mode"] in (("ext_arg", "poll") if wait_mode == "auto" else ("poll",)), result
    message, seconds, in_kernel, queued = result["wait"]
    assert message == "io_uring wait: no completion in 0.5 s with 1 ops in flight", result
    assert 0.5 <= seconds < 5 and in_kernel == 1 and queued == 1, result  # the timeout, despite 50 ms signals
    assert result["late"] == [[1, 4096]], result
    message, seconds = result["close"]
    assert message == ("io_uring close: no completion in 0.3 s with 1 ops still in the kernel; their buffers are "
                       "leaked, never freed under the kernel"), result
    assert 0.3 <= seconds < 5, result
    assert result["closed"] == "I/O on a closed Ring", result


NOTHING_QUEUED = """
    import json, os
    from memstrata.runtime import _native
    r, w = os.pipe()
    out = {}
    for kind in (_native.Ring, _native.Threads):
        q = kind(2, [r], timeout_s=5)
        try:
            q.wait(1)
            out[kind.__name__] = "returned"
        except ValueError as e:
            out[kind.__name__] = [str(e), q.wait(0), q.wait(-1)]
        q.close()
    print(json.dumps(out))
"""


def test_a_wait_for_more_than_is_queued_is_refused_at_once() -> None:
    result = run_child(NOTHING_QUEUED)
    refused = ["wait(1) with only 0 ops queued would never return", [], []]
    assert result == {"Ring": refused, "Threads": refused}, result


def test_engine_wait_on_a_handle_whose_ops_the_queue_does_not_hold_fails_instead_of_spinning(tmp_path: Path) -> None:
    path = str(tmp_path / "dev.img")
    with open(path, "wb") as f:
        f.truncate(8 * MiB)
    with NvmeEngine.open([path], job="t/lost", io_timeout_s=5) as eng:
        lost = Handle("read", eng.allocate(4096))
        lost.pending = 1  # as if its op had been dropped below the engine
        with pytest.raises(NvmeError, match=r"read of 4096 bytes did not complete: 0 ops in flight here, none in "
                                            r"the I/O queue") as info:
            eng.wait(lost)
        assert info.value.device == path


# -- a device that stops answering: a frozen filesystem holds every write until it is thawed ----------
FROZEN = """
    import json, subprocess, sys, time
    from memstrata.runtime.strata.errors import NvmeError
    from memstrata.runtime.strata.nvme import NvmeEngine
    path, mnt, backend = sys.argv[1:4]
    out = {}
    try:
        eng = NvmeEngine.open([path], job="t/frozen", io_backend=backend, io_timeout_s=1)
        ext = eng.allocate(64 << 10)
        eng.wait(eng.write(ext, b"a" * (64 << 10)))  # the device answers
        subprocess.run(["fsfreeze", "--freeze", mnt], check=True)
        h = eng.write(ext, b"b" * (64 << 10))
        start = time.monotonic()
        try:
            eng.wait(h)
        except NvmeError as e:
            out["wait"] = [e.errno, e.device, str(e), time.monotonic() - start]
        start = time.monotonic()
        try:
            eng.close()
        except NvmeError as e:
            out["close"] = [e.errno, time.monotonic() - start]
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", mnt], capture_output=True)  # the stuck write then ends
    print(json.dumps(out), flush=True)
"""


@pytest.fixture
def frozen_mount(loopdev, tmp_path: Path):
    """An ext4 filesystem on a loop device, mounted; thawed and unmounted whatever the test did."""
    need_tool("mkfs.ext4", "e2fsprogs")
    need_tool("fsfreeze", "util-linux")
    dev = loopdev(64 * MiB)
    run("mkfs.ext4", "-q", "-F", dev)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run("mount", dev, str(mnt))
    try:
        yield mnt
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(mnt)], capture_output=True, timeout=60)
        # A dead child's io_uring is torn down by the kernel in the background, and holds the
        # filesystem busy until then: retry, and detach it lazily if it stays busy.
        deadline = time.monotonic() + 30
        while subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60).returncode != 0:
            if time.monotonic() > deadline:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)
                break
            time.sleep(0.1)


@pytest.mark.loopdev
@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_a_device_that_stops_answering_fails_the_wait_and_close_within_the_timeout(frozen_mount: Path,
                                                                                  backend: str) -> None:
    path = frozen_mount / "dev.img"
    with open(path, "wb") as f:
        f.truncate(16 * MiB)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FROZEN), str(path), str(frozen_mount), backend],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        stdout, stderr = proc.communicate(timeout=CHILD_LIMIT_S)
    except subprocess.TimeoutExpired:
        # Thaw first: a child whose write is held cannot even exit before.
        subprocess.run(["fsfreeze", "--unfreeze", str(frozen_mount)], capture_output=True, timeout=60)
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the child hung for {CHILD_LIMIT_S} s (an unbounded wait): {stdout!r} {stderr!r}")
    assert proc.returncode == 0, stderr
    result = json.loads(stdout.splitlines()[-1])
    code, device, message, seconds = result["wait"]
    assert code == 110 and device == str(path) and 1 <= seconds < 10, result
    what = {"io_uring": "io_uring wait: no completion in 1.0 s with 1 ops in flight",
            "threads": "I/O threads wait: no completion in 1.0 s with 1 ops in flight"}[backend]
    assert f"write of {64 << 10} bytes did not complete: {what}" in message, message
    assert f"[{backend}; ops in flight: 1 on {path}]" in message, message
    # close: wait_all times out the same way, then the queue gets a second's grace and leaks the stuck op.
    code, seconds = result["close"]
    assert code == 110 and 1 <= seconds < 15, result
    header = parse_header(read_head(str(path), 4096))
    assert header is not None and header.state == State.OPEN, header  # the node agent scrubs it
