"""Job A's recognisable data on a real device, a kill that lands with I/O in flight, and every byte read back.

Shared by the engine's scrub tests (tests/native) and the node agent's (tests/nodeagent), which import
it by name.
"""
from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time

from native_helpers import child_env

MiB = 1 << 20
JOB_A = "tenant-a/secret-job"
MARK = b"TENANT-A-OPTIMIZER-STATE"  # every 32-byte record of job A starts with it

# Job A through the real engine: fills `count` 4 MiB extents with records, frees the last one (freed
# extents keep their bytes on the device), then either closes when told ("close") or rewrites the
# rest until it is killed ("loop").
WRITER = textwrap.dedent("""
    import sys
    from memstrata.runtime.strata.nvme import NvmeEngine
    dev, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    block = b"".join(b"%s%08d" % (MARK, i) for i in range((4 << 20) // 32))
    eng = NvmeEngine.open([dev], job=JOB, queue_depth=8)
    exts = [eng.allocate(len(block)) for _ in range(count)]
    for e in exts:
        eng.wait(eng.write(e, block))
    eng.free(exts.pop())
    print("written", flush=True)
    if mode == "close":
        sys.stdin.readline()
        eng.close()
        print("closed", flush=True)
    while mode == "loop":
        for h in [eng.write(e, block) for e in exts]:
            eng.wait(h)
""").replace("MARK", repr(MARK)).replace("JOB", repr(JOB_A))


def start_writer(dev: str, mode: str, count: int = 10) -> subprocess.Popen[str]:
    """Job A in a child process, returned once all its records are on `dev`."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, dev, mode, str(count)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if line != "written":
        child.kill()
        raise AssertionError(f"job A did not start: {line!r} {child.communicate()[1]}")
    return child


def close_writer(child: subprocess.Popen[str]) -> None:
    """Tell a "close" writer to close its engine cleanly, and wait for it to exit."""
    out, err = child.communicate("\n", timeout=120)
    assert child.returncode == 0 and "closed" in out, err


def inflight_writes(dev: str) -> int:
    name = os.path.basename(os.path.realpath(dev))
    with open(f"/sys/block/{name}/inflight") as f:
        return int(f.read().split()[1])


def kill_mid_write(child: subprocess.Popen[str], dev: str, timeout: float = 20.0) -> int:
    """SIGKILL `child` the moment the block layer shows one of its writes in flight on `dev`;
    returns how many were in flight just before the signal (0 only if the deadline passed)."""
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline and not seen:
        seen = inflight_writes(dev)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    return seen


def read_all(dev: str) -> bytes:
    """Every byte of `dev`, read O_DIRECT so that no page cache stands between the test and the device."""
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    chunks = []
    buf = mmap.mmap(-1, 4 * MiB)
    try:
        offset = 0
        while got := os.preadv(fd, [buf], offset):
            chunks.append(bytes(buf[:got]))
            offset += got
    finally:
        buf.close()
        os.close(fd)
    return b"".join(chunks)


def traces_of_a(data: bytes) -> list[str]:
    """What job A left readable in `data`: its records, its name. Empty means nothing."""
    found = []
    if (at := data.find(MARK)) >= 0:
        found.append(f"a record of job A at offset {at}")
    if (at := data.find(JOB_A.split("/")[0].encode())) >= 0:
        found.append(f"job A's name at offset {at}")
    return found
