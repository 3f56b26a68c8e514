"""One tenant's data is never readable by the next, on real loop devices.

Job A writes recognisable records through the real engine; then job B (or the node agent's scrub)
reads every byte of the device and must find none of them: after a clean close (the engine zeroes
what it wrote), and after a SIGKILL that lands with A's writes in flight (the node agent scrubs
the namespace A left OPEN, after the safety rule passed).
"""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from native_helpers import need_tool, run
from scrub_helpers import JOB_A, MiB, close_writer, kill_mid_write, read_all, start_writer, traces_of_a

from memstrata.node import scrub
from memstrata.node.header import DATA_OFFSET, HEADER_BYTES, MAGIC, State, parse_header
from memstrata.node.safety import DeviceUnsafeError
from memstrata.node.scrub import SCRUBBED_OWNER, hold, pending_reason, scrub_held
from memstrata.runtime.strata.nvme import NvmeEngine


def held(dev: str, timeout: float = 20.0) -> int:
    """The device held exclusively, once the killed engine's io_uring has let go of it."""
    deadline = time.monotonic() + timeout
    while (fd := hold(dev)) is None:
        assert time.monotonic() < deadline, f"{dev} still held by another process after {timeout} s"
        time.sleep(0.05)
    return fd


def assert_clean(dev: str) -> None:
    data = read_all(dev)
    assert traces_of_a(data) == []
    head = parse_header(data[:HEADER_BYTES])
    assert head is not None and head.state == State.SCRUBBED and head.owner_job == SCRUBBED_OWNER
    assert data[HEADER_BYTES:].count(0) == len(data) - HEADER_BYTES  # every byte behind the header is zero


@pytest.mark.loopdev
def test_after_a_clean_close_job_b_reads_nothing_of_job_a(loopdev) -> None:
    dev = loopdev(64 * MiB)
    close_writer(start_writer(dev, "close"))
    assert_clean(dev)
    with NvmeEngine.open([dev], job="tenant-b/job") as eng:  # job B, reading all it can allocate
        assert eng.recovered == []
        ext = eng.allocate(eng.stats()[0].space.capacity_bytes)
        out = bytearray(ext.nbytes)
        eng.wait(eng.read(ext, out))
        assert traces_of_a(bytes(out)) == [] and out.count(0) == len(out)


@pytest.mark.loopdev
def test_a_job_killed_mid_write_is_scrubbed_by_the_node_agent_path(loopdev) -> None:
    dev = loopdev(64 * MiB)
    child = start_writer(dev, "loop")
    in_flight = kill_mid_write(child, dev)
    assert in_flight > 0, "the kill did not land while job A's writes were in flight"
    before = read_all(dev)
    assert traces_of_a(before), "job A's records should be on the device before the scrub"
    assert pending_reason(before[:HEADER_BYTES]) == "a job left it OPEN without scrubbing it"
    fd = held(dev)
    try:
        done = scrub_held(fd, dev)
    finally:
        os.close(fd)
    assert done is not None and "zeroed" in done
    assert_clean(dev)
    with NvmeEngine.open([dev], job="tenant-b/job") as eng:
        assert eng.recovered == []  # nothing stale left: the agent scrubbed it


@pytest.mark.loopdev
def test_a_job_that_claims_a_dirty_namespace_zeroes_all_of_it_on_close(loopdev) -> None:
    # No agent came between: job B gets the namespace job A left OPEN, and writes little itself.
    dev = loopdev(64 * MiB)
    kill_mid_write(start_writer(dev, "loop"), dev)
    # The killed engine's io_uring lets go of the device asynchronously: open waits for it.
    with NvmeEngine.open([dev], job="tenant-b/job", busy_timeout_s=20) as eng:
        assert [h.owner_job for _, h in eng.recovered] == [JOB_A]
        eng.wait(eng.write(eng.allocate(4096), b"b" * 4096))
    assert_clean(dev)


@pytest.mark.loopdev
def test_the_agent_never_scrubs_a_namespace_that_is_held_or_unsafe(loopdev) -> None:
    need_tool("sgdisk", "gdisk")
    dev = loopdev(64 * MiB)
    child = start_writer(dev, "loop")
    try:
        assert hold(dev) is None  # job A holds it: in use, not to be touched
    finally:
        kill_mid_write(child, dev)
    os.close(held(dev))  # every write of job A has landed
    run("sgdisk", "-o", dev)  # a GPT written over the OPEN header: someone's disk now
    before = read_all(dev)
    assert before.startswith(MAGIC) and pending_reason(before[:HEADER_BYTES]) is not None
    fd = held(dev)
    try:
        with pytest.raises(DeviceUnsafeError, match=rf"^{dev}: refusing to use it: foreign signature: gpt"):
            scrub_held(fd, dev)
    finally:
        os.close(fd)
    assert read_all(dev) == before  # not one byte written


def test_file_stratum_is_zeroed_on_close(tmp_path: Path) -> None:
    # A regular file (a local run's stratum): no root needed, the same rule.
    path = tmp_path / "stratum.img"
    path.write_bytes(b"")
    os.truncate(path, 32 * MiB)
    record = b"TENANT-A-OPTIMIZER-STATE00000000" * (MiB // 32)
    with NvmeEngine.open([str(path)], job=JOB_A) as eng:
        exts = [eng.allocate(MiB) for _ in range(5)]
        for e in exts:
            eng.wait(eng.write(e, record))
        eng.free(exts[2])
        assert traces_of_a(path.read_bytes())
    data = path.read_bytes()
    assert traces_of_a(data) == [] and data[DATA_OFFSET:].count(0) == len(data) - DATA_OFFSET
    head = parse_header(data)
    assert head is not None and head.state == State.SCRUBBED


@pytest.mark.loopdev
@pytest.mark.parametrize(("promise", "unsupported", "lying", "method"), [
    (False, (), (), "punch-hole"),  # what a modern kernel does: Write Zeroes that may deallocate
    (False, ("punch-hole",), (), "zeroout"),  # no Write Zeroes with deallocation: BLKZEROOUT
    (True, (), (), "discard"),  # queue/discard_zeroes_data says 1: BLKDISCARD
    (True, (), ("discard",), "punch-hole"),  # ... but the discarded blocks still read back data
])
def test_each_way_of_zeroing_a_block_device_leaves_only_zeros(loopdev, monkeypatch: pytest.MonkeyPatch,
                                                              promise: bool, unsupported: tuple[str, ...],
                                                              lying: tuple[str, ...], method: str) -> None:
    dev = loopdev(16 * MiB)
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT | os.O_EXCL)
    try:
        scrub.direct_write(fd, 0, b"TENANT-A-OPTIMIZER-STATE00000000" * (16 * MiB // 32))
        real_zero = scrub._zero

        def zero(fd: int, how: str, offset: int, length: int) -> None:
            if how in unsupported:
                raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
            if how not in lying:
                real_zero(fd, how, offset, length)  # type: ignore[arg-type]

        monkeypatch.setattr(scrub, "_zero", zero)
        monkeypatch.setattr(scrub, "_discard_zeroes_data", lambda rdev, root: promise)
        assert scrub.zero_range(fd, dev, HEADER_BYTES, 16 * MiB, block=512).endswith(f"zeroed by {method}")
    finally:
        os.close(fd)
    data = read_all(dev)
    assert data[:HEADER_BYTES].startswith(b"TENANT-A")  # the range's bounds are kept
    assert data[HEADER_BYTES:].count(0) == 16 * MiB - HEADER_BYTES
