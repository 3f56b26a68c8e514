"""Making a namespace unreadable before another job may have it: the one scrub rule.

A job's optimizer state on a raw namespace must never reach the next tenant. The raw-NVMe
engine, closing cleanly, zeroes every byte it may have written and only then stamps its header
SCRUBBED (memstrata.runtime.strata.claim); a job killed before that leaves the header OPEN, and
the node agent scrubs the whole namespace once no process holds it (memstrata.nodeagent.scrubber),
after the namespace-safety rule (memstrata.node.safety) has passed on the held device. Both decide
with `pending_reason`, zero with `zero_range` and stamp `scrubbed_header`.

Zeroing, best first; each is used only where the kernel promises the range then reads as zeros:
- BLKDISCARD, only where queue/discard_zeroes_data says 1 (kernels before 4.12): a plain
  discard may leave the old data readable;
- fallocate(PUNCH_HOLE) on the block device: the kernel's Write Zeroes that may deallocate (an
  NVMe Write Zeroes with DEAC, a hole in a loop device's file), refused where the device cannot
  do it (EOPNOTSUPP), never a silent plain discard. On a regular file, a hole;
- BLKZEROOUT: Write Zeroes without deallocating, or zero pages the kernel writes itself;
- zeros written from here, where the kernel offers none of these.
Then a sample of blocks is read back: one that is not zero is an error naming the device,
whatever the method promised.

Everything above the "devices" section is pure.
"""
from __future__ import annotations

import ctypes
import errno as E
import fcntl
import logging
import mmap
import os
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

from memstrata.node.header import (
    DATA_OFFSET, HEADER_BYTES, Header, HeaderError, State, parse_header, render_header,
)
from memstrata.node.safety import check_device

__all__ = ["ScrubError", "hold", "pending_reason", "scrub_held", "scrubbed_header", "write_scrubbed", "zero_range"]

log = logging.getLogger(__name__)

Method = Literal["discard", "punch-hole", "zeroout", "write"]
# A scrubbed header names no job: the next tenant learns nothing about the last one.
SCRUBBED_OWNER = "(scrubbed)"
# One request per GiB: progress can be logged, and a stop request is seen within one chunk.
CHUNK_BYTES = 1 << 30
PROGRESS_EVERY_S = 5.0
VERIFY_SAMPLES = 64
_WRITE_BYTES = 1 << 20  # the last resort's zero buffer

_BLKDISCARD = 0x1277
_BLKZEROOUT = 0x127F
_BLKSSZGET = 0x1268
_BLKGETSIZE64 = 0x80081272
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
# The method does not exist for this device or kernel: the next one is tried. Any other error stops the scrub.
_UNSUPPORTED = frozenset({E.EOPNOTSUPP, E.ENOTTY, E.ENOSYS})


class ScrubError(Exception):
    """A scrub that did not finish; names the device, and where and why it stopped."""

    def __init__(self, device: str, reason: str, *, offset: int | None = None, length: int | None = None,
                 errno: int | None = None) -> None:
        self.device, self.reason, self.offset, self.length, self.errno = device, reason, offset, length, errno
        where = device + (f" at offset {offset}" if offset is not None else "") + (
            f" length {length}" if length is not None else "")
        err = f" [{E.errorcode.get(errno, str(errno))}: {os.strerror(errno)}]" if errno else ""
        super().__init__(f"{where}: cannot scrub: {reason}{err}")


# -- the rule ----------------------------------------------------------------------------------------
def pending_reason(head: bytes) -> str | None:
    """Why the device must be scrubbed before another job may have it; None when it need not be.

    Only memstrata's own header tells that a job used the device, so a device without one is
    the safety rule's business, not this one's. Every state but SCRUBBED, and a header that
    cannot be read, may have a job's data behind it."""
    try:
        header = parse_header(head)
    except HeaderError as exc:
        return f"its memstrata header is unreadable ({exc}), so a job's data may be on it"
    if header is None or header.state == State.SCRUBBED:
        return None
    return f"a job left it {header.state.name} without scrubbing it"


def methods(is_block: bool, discard_zeroes_data: bool) -> tuple[Method, ...]:
    """The ways to zero a device, best first (see the module's docstring)."""
    if not is_block:
        return ("punch-hole", "write")
    best: tuple[Method, ...] = ("punch-hole", "zeroout", "write")
    return ("discard", *best) if discard_zeroes_data else best


def scrubbed_header(old: Header | None, *, logical_block_size: int, size: int, now_ns: int) -> Header:
    """The header of a device once scrubbed: the generation goes on, the last owner's name and pid do not.

    `old` None (no readable header) gets one that describes the whole device as a single set."""
    if old is not None:
        return replace(old, state=State.SCRUBBED, owner_job=SCRUBBED_OWNER, owner_pid=0, updated_ns=now_ns)
    capacity = (size - DATA_OFFSET) // logical_block_size * logical_block_size if size > DATA_OFFSET else 0
    return Header(owner_job=SCRUBBED_OWNER, generation=1, state=State.SCRUBBED, set_id=uuid.UUID(int=0),
                  set_index=0, set_size=1, logical_block_size=logical_block_size, capacity_bytes=capacity,
                  updated_ns=now_ns)


def chunks(start: int, end: int, size: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """[start, end) as (offset, length) pieces of at most `size` bytes."""
    for lo in range(start, end, size):
        yield lo, min(size, end - lo)


def sample_offsets(start: int, end: int, block: int, count: int = VERIFY_SAMPLES) -> list[int]:
    """Offsets of up to `count` whole `block`s spread evenly over [start, end), first and last included."""
    blocks = (end - start) // block
    if blocks <= 0 or count <= 0:
        return []
    if blocks <= count:
        return [start + i * block for i in range(blocks)]
    return sorted({start + (i * (blocks - 1) // (count - 1)) * block for i in range(count)})


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


# -- devices -----------------------------------------------------------------------------------------
def direct_read(fd: int, offset: int, nbytes: int) -> bytes:
    """Up to `nbytes` at `offset` through a page-aligned buffer (what O_DIRECT needs); short at the end of a file."""
    buf = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    try:
        got = os.preadv(fd, [memoryview(buf)[:nbytes]], offset)
        return bytes(buf[:got])
    finally:
        buf.close()


def direct_write(fd: int, offset: int, data: bytes) -> None:
    """All of `data` at `offset` through a page-aligned buffer; a short write is OSError(EIO)."""
    buf = mmap.mmap(-1, -(-len(data) // mmap.PAGESIZE) * mmap.PAGESIZE)
    try:
        buf[: len(data)] = data
        done = os.pwritev(fd, [memoryview(buf)[: len(data)]], offset)
        if done != len(data):
            raise OSError(E.EIO, f"short write: {done} of {len(data)} bytes")
    finally:
        buf.close()


def _discard_zeroes_data(rdev: int, sysfs_root: str) -> bool:
    # Kernels since 4.12 always say 0 here: a discard there promises nothing about what reads return.
    attr = Path(sysfs_root, "dev", "block", f"{os.major(rdev)}:{os.minor(rdev)}", "queue", "discard_zeroes_data")
    try:
        return attr.read_text().strip() == "1"
    except OSError:
        return False


_fallocate: Callable[[int, int, int, int], int] | None = None


def _punch_hole(fd: int, offset: int, length: int) -> None:
    global _fallocate
    if _fallocate is None:  # os has no fallocate with a mode; glibc's, with 64-bit offsets on every 64-bit ABI
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        libc.fallocate.restype = ctypes.c_int
        _fallocate = libc.fallocate
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write_zeros(fd: int, offset: int, length: int) -> None:
    zeros = mmap.mmap(-1, _WRITE_BYTES)  # anonymous maps are zero and page-aligned
    try:
        for lo, n in chunks(offset, offset + length, _WRITE_BYTES):
            done = os.pwritev(fd, [memoryview(zeros)[:n]], lo)
            if done != n:
                raise OSError(E.EIO, f"short write: {done} of {n} bytes at offset {lo}")
    finally:
        zeros.close()


def _zero(fd: int, method: Method, offset: int, length: int) -> None:
    if method == "discard":
        fcntl.ioctl(fd, _BLKDISCARD, struct.pack("QQ", offset, length))
    elif method == "punch-hole":
        _punch_hole(fd, offset, length)
    elif method == "zeroout":
        fcntl.ioctl(fd, _BLKZEROOUT, struct.pack("QQ", offset, length))
    else:
        _write_zeros(fd, offset, length)


def _verify(fd: int, device: str, start: int, end: int, block: int) -> int:
    samples = sample_offsets(start, end, block)
    for off in samples:
        try:
            got = direct_read(fd, off, min(block, end - off))
        except OSError as exc:
            raise ScrubError(device, "cannot read the zeroed range back", offset=off, length=block,
                             errno=exc.errno) from None
        if got.count(0) != len(got):  # a short read past a file's end holds nothing: fine
            raise ScrubError(device, "a block still holds data after zeroing", offset=off, length=len(got))
    return len(samples)


def _zero_all(fd: int, device: str, start: int, end: int, order: list[Method],
              stop: Callable[[], bool]) -> Method:
    total, done = end - start, 0
    began = last = time.monotonic()
    for lo, n in chunks(start, end):
        if stop():
            raise ScrubError(device, f"stopped after {_mib(done)} of {_mib(total)}", offset=lo)
        while True:
            try:
                _zero(fd, order[0], lo, n)
                break
            except OSError as exc:
                if exc.errno in _UNSUPPORTED and len(order) > 1:
                    log.info("%s: %s is not supported here (%s); zeroing by %s instead", device, order[0],
                             os.strerror(exc.errno or 0), order[1])
                    order.pop(0)
                    continue
                raise ScrubError(device, f"{order[0]} failed", offset=lo, length=n, errno=exc.errno) from None
        done += n
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            log.info("%s: scrubbed %s of %s (%d%%) by %s, %.0f s so far", device, _mib(done), _mib(total),
                     100 * done // total, order[0], last - began)
    return order[0]


def zero_range(fd: int, device: str, start: int, end: int, *, block: int, sysfs_root: str = "/sys",
               stop: Callable[[], bool] = lambda: False) -> str:
    """Make [start, end) of the device open as `fd` (read-write, O_DIRECT, held exclusively) read as
    zeros, flush it, and read a sample back. Returns how it was done, for the log.

    `block` is the device's logical block size: the range's alignment and the sample's unit.
    `stop` is asked between chunks (the node agent stopping). Raises ScrubError naming the device."""
    if end <= start:
        return "nothing to zero"
    if start % block or end % block:
        raise ScrubError(device, f"range [{start}, {end}) is not aligned to the block size {block}")
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise ScrubError(device, "cannot stat it", errno=exc.errno) from None
    is_block = stat.S_ISBLK(st.st_mode)
    order = list(methods(is_block, is_block and _discard_zeroes_data(st.st_rdev, sysfs_root)))
    log.info("%s: scrubbing %s from offset %d by %s", device, _mib(end - start), start, order[0])
    began = time.monotonic()
    method = _zero_all(fd, device, start, end, order, stop)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise ScrubError(device, "flushing the zeroed range failed", errno=exc.errno) from None
    try:
        checked = _verify(fd, device, start, end, block)
    except ScrubError:
        if method != "discard":
            raise
        # discard_zeroes_data promised what this device did not keep: zero it for real.
        log.warning("%s: discarded blocks still read back data; zeroing again without discard", device)
        order = [m for m in order if m != "discard"]
        method = _zero_all(fd, device, start, end, order, stop)
        checked = _verify(fd, device, start, end, block)
    log.info("%s: scrubbed %s by %s in %.1f s; %d sampled blocks read back as zeros", device,
             _mib(end - start), method, time.monotonic() - began, checked)
    return f"{_mib(end - start)} zeroed by {method}"


def write_scrubbed(fd: int, device: str, header: Header) -> None:
    """Stamp `header` (a scrubbed one) and flush it: the last step, once the data is zero on the device."""
    try:
        direct_write(fd, 0, render_header(header))
        os.fsync(fd)
    except OSError as exc:
        raise ScrubError(device, "writing the SCRUBBED header failed", offset=0, length=HEADER_BYTES,
                         errno=exc.errno) from None


def hold(path: str) -> int | None:
    """`path` open read-write, O_DIRECT and exclusively (O_EXCL on a block device); None while another
    process holds it exclusively: the raw-NVMe engine of the job that owns it does, and so does a mount."""
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT | os.O_EXCL | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == E.EBUSY:
            return None
        raise ScrubError(path, "cannot open it exclusively", errno=exc.errno) from None


def _geometry(fd: int, device: str) -> tuple[int, int]:
    try:
        lbs = struct.unpack("i", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
        size = struct.unpack("Q", fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8))[0]
    except OSError as exc:
        raise ScrubError(device, "cannot read its block size and capacity", errno=exc.errno) from None
    return int(lbs), int(size)


def scrub_held(fd: int, path: str, *, sysfs_root: str = "/sys", mountinfo: str = "/proc/self/mountinfo",
               swaps: str = "/proc/swaps", stop: Callable[[], bool] = lambda: False,
               used: str | None = None) -> str | None:
    """Scrub all of the block device `fd` holds (from `hold`) when its header says a job's data may be
    on it, or whatever it says when `used` says who had it (a DRA claim's pod, whose writes need not have
    left memstrata's header), then stamp it SCRUBBED. Returns what was done, for the log; None when nothing
    was needed.

    The namespace-safety rule (memstrata.node.safety.check_device) is applied first, on the held device:
    a namespace that gained a partition table, a filesystem, a holder or a mount is never written. Raises
    DeviceUnsafeError or ScrubError, both naming the device."""
    if not check_device(path, sysfs_root=sysfs_root, mountinfo=mountinfo, swaps=swaps):
        raise ScrubError(path, "not a block device")
    try:  # the device checked must be the one held, whatever happened to the node's name since
        same = os.fstat(fd).st_rdev == os.stat(path).st_rdev
    except OSError as exc:
        raise ScrubError(path, "cannot stat it", errno=exc.errno) from None
    if not same:
        raise ScrubError(path, "its device node now names another device than the one held")
    try:
        head = direct_read(fd, 0, HEADER_BYTES)
    except OSError as exc:
        raise ScrubError(path, "cannot read its header", offset=0, length=HEADER_BYTES, errno=exc.errno) from None
    reason = pending_reason(head) or used
    if reason is None:
        return None  # scrubbed (by its engine's close) since the agent looked
    try:
        old = parse_header(head)
    except HeaderError:
        old = None
    lbs, size = _geometry(fd, path)
    owner = f"job {old.owner_job}, pid {old.owner_pid}" if old else "owner unknown"
    log.info("%s: %s (%s); scrubbing all %s before it is offered again", path, reason, owner, _mib(size))
    # Everything behind the header, then the header last: killed half way, it still says "not scrubbed".
    start = -(-HEADER_BYTES // lbs) * lbs
    done = zero_range(fd, path, start, size, block=lbs, sysfs_root=sysfs_root, stop=stop)
    write_scrubbed(fd, path, scrubbed_header(old, logical_block_size=lbs, size=size, now_ns=time.time_ns()))
    return done
