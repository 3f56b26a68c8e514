"""Opening, claiming and releasing one device of the raw-NVMe engine: safety rule, exclusive hold, header, scrub.

Opening checks the device (memstrata.node.safety), takes it exclusively (O_EXCL for block
devices, flock for all), checks it again now that it is held, and reads its size; claiming
stamps a fresh OPEN header over whatever a killed run left; releasing zeroes what the job may
have written (memstrata.node.scrub) and only then stamps the header SCRUBBED, so that the next
job reads zeros, never this one's data. Plain synchronous O_DIRECT I/O, no io_uring: this is
the part of the engine that runs before and after the ring.
"""
from __future__ import annotations

import errno as E
import fcntl
import os
import struct
import time
import uuid

from memstrata.node.header import DATA_OFFSET, HEADER_BYTES, Header, HeaderError, State, parse_header, render_header
from memstrata.node.safety import DeviceUnsafeError, check_device
from memstrata.node.scrub import ScrubError, direct_read, direct_write, pending_reason, scrubbed_header, \
    write_scrubbed, zero_range
from memstrata.runtime.strata.errors import DeviceRefusedError, NvmeError

__all__ = ["aligned_io", "claim_device", "open_device", "release_device"]

_BLKSSZGET = 0x1268
_BLKGETSIZE64 = 0x80081272
# O_DIRECT on regular files must be aligned to the filesystem block; 4 KiB
# covers every filesystem in use.
_FILE_BLOCK = 4096


def aligned_io(fd: int, path: str, offset: int, data: bytes | None, nbytes: int) -> bytes:
    """One synchronous O_DIRECT pread/pwrite through a page-aligned buffer (memstrata.node.scrub's)."""
    try:
        if data is not None:
            block = data[:nbytes].ljust(nbytes, b"\0")
            direct_write(fd, offset, block)
            return block
        got = direct_read(fd, offset, nbytes)
    except OSError as exc:
        raise NvmeError(f"header {'write' if data else 'read'} failed", device=path, offset=offset,
                        length=nbytes, errno=exc.errno) from None
    if len(got) != nbytes:
        raise NvmeError(f"short read of {len(got)} bytes", device=path, offset=offset, length=nbytes, errno=E.EIO)
    return got


def _open_excl(path: str, is_block: bool) -> int:
    """Open and take the device exclusively, or raise BlockingIOError/OSError(EBUSY)."""
    fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | (os.O_EXCL if is_block else 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _checked(path: str, force: bool) -> bool:
    """The namespace-safety rule for `path` (True for a block device), refusals as engine errors."""
    try:
        return check_device(path, force=force)
    except DeviceUnsafeError as exc:
        raise DeviceRefusedError(exc) from None


def open_device(path: str, force: bool, busy_timeout_s: float) -> tuple[int, int, int]:
    """(fd, logical block size, size in bytes) of a safe, exclusively held device.

    A process killed with I/O in flight keeps its files referenced until the
    kernel has torn its io_uring down (asynchronously, after the exit), so
    "busy" is retried for `busy_timeout_s` before it is reported."""
    is_block = _checked(path, force)
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            fd = _open_excl(path, is_block)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise NvmeError("in use by another memstrata engine", device=path, errno=E.EBUSY) from None
        except OSError as exc:
            if exc.errno == E.EBUSY and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            why = {E.EBUSY: "busy: mounted or held exclusively by another process",
                   E.EINVAL: "its filesystem does not support O_DIRECT"}.get(exc.errno or 0, "cannot open")
            raise NvmeError(why, device=path, errno=exc.errno) from None
        time.sleep(0.05)
    try:
        # Again, now that the device is held: a writer that does not take it exclusively (dd, sgdisk,
        # wipefs) may have labelled it between the first check and the open, and nothing here has
        # written yet. With O_EXCL held no filesystem can be mounted on it from now on.
        _checked(path, force)
        if is_block:
            lbs = struct.unpack("i", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
            size = struct.unpack("Q", fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8))[0]
        else:
            lbs, size = _FILE_BLOCK, os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise
    return fd, lbs, size


def claim_device(path: str, fd: int, lbs: int, size: int, job: str, set_id: uuid.UUID, index: int,
           count: int) -> tuple[Header, Header | None, int]:
    """Stamp a fresh OPEN header; returns it, the stale OPEN one it replaced (if any), and the end of
    what a clean close must zero so far (`release_device`).

    The rest of the reserved zone [HEADER_BYTES, DATA_OFFSET) is zeroed first: a
    signature a forced open overrode (btrfs at 64 KiB, GPT at 4 KiB) must not
    outlive it, or the next check, which probes behind memstrata's header too,
    would refuse memstrata's own device.

    Where the replaced header was not SCRUBBED (a killed run, an old build's CLOSED, a damaged
    header) someone's data may lie anywhere in the data area, so all of it is to be zeroed on
    close; else only what this engine allocates (the engine moves the end as it does)."""
    capacity = (size - DATA_OFFSET) // lbs * lbs if size > DATA_OFFSET else 0
    if capacity < lbs:
        raise NvmeError(f"too small: {size} bytes, memstrata needs more than {DATA_OFFSET}", device=path)
    head = aligned_io(fd, path, 0, None, HEADER_BYTES)
    aligned_io(fd, path, HEADER_BYTES, bytes(DATA_OFFSET - HEADER_BYTES), DATA_OFFSET - HEADER_BYTES)
    dirty_end = DATA_OFFSET + capacity if pending_reason(head) is not None else DATA_OFFSET
    try:
        old = parse_header(head)
    except HeaderError:
        old = None  # ours but damaged (killed mid header write): nothing to keep
    header = Header(owner_job=job, generation=(old.generation + 1) if old else 1, state=State.OPEN,
                    set_id=set_id, set_index=index, set_size=count, logical_block_size=lbs,
                    capacity_bytes=capacity, owner_pid=os.getpid(), updated_ns=time.time_ns())
    aligned_io(fd, path, 0, render_header(header), HEADER_BYTES)
    os.fsync(fd)
    return header, old if old is not None and old.state == State.OPEN else None, dirty_end


def release_device(path: str, fd: int, header: Header, lbs: int, dirty_end: int) -> str:
    """Zero [DATA_OFFSET, dirty_end), then stamp the header SCRUBBED; returns what was done, for the log.

    Only a clean close calls this, once no I/O is in flight. If zeroing fails the header stays OPEN,
    which the node agent reads as "scrub me before anyone gets it": the error says so."""
    try:
        done = zero_range(fd, path, DATA_OFFSET, dirty_end, block=lbs)
        write_scrubbed(fd, path, scrubbed_header(header, logical_block_size=lbs, size=0, now_ns=time.time_ns()))
    except ScrubError as exc:
        raise NvmeError(f"scrub on close failed: {exc.reason}; its header stays OPEN, so the node agent scrubs "
                        "it before another job may have it", device=path, offset=exc.offset, length=exc.length,
                        errno=exc.errno) from None
    return done
