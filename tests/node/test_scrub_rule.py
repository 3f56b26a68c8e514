"""The scrub rule's pure parts (header states, the choice of method, the scrubbed header) and its
zeroing on a regular file, which needs no root: what a namespace must go through before the next job."""
from __future__ import annotations

import errno
import os
import struct
import uuid
import zlib
from pathlib import Path

import pytest

from memstrata.node import scrub
from memstrata.node.header import DATA_OFFSET, HEADER_BYTES, Header, State, parse_header, render_header
from memstrata.node.scrub import (
    SCRUBBED_OWNER, ScrubError, chunks, methods, pending_reason, sample_offsets, scrubbed_header, zero_range,
)

GiB = 1 << 30
MiB = 1 << 20


def _header(state: State, **kw: object) -> Header:
    base: dict[str, object] = dict(owner_job="tenant-a/job", generation=4, state=state, set_id=uuid.UUID(int=9),
                                   set_index=1, set_size=2, logical_block_size=4096, capacity_bytes=GiB,
                                   owner_pid=77, updated_ns=5)
    base.update(kw)
    return Header(**base)  # type: ignore[arg-type]


def test_scrubbed_is_a_state_of_its_own_that_round_trips() -> None:
    assert [s.name for s in State] == ["CLOSED", "OPEN", "SCRUBBED"]
    assert (State.CLOSED, State.OPEN) == (0, 1)  # what earlier builds wrote still reads the same
    h = _header(State.SCRUBBED)
    assert parse_header(render_header(h)) == h


@pytest.mark.parametrize(("head", "reason"), [
    (bytes(HEADER_BYTES), None),  # no memstrata header: never a job's namespace, the safety rule decides
    (b"\x55" * HEADER_BYTES, None),
    (render_header(_header(State.SCRUBBED)), None),
    (render_header(_header(State.OPEN)), "a job left it OPEN without scrubbing it"),  # killed, or still running
    # What every earlier build wrote on close: its data is still there.
    (render_header(_header(State.CLOSED)), "a job left it CLOSED without scrubbing it"),
])
def test_only_a_scrubbed_header_lets_a_namespace_go_to_the_next_job(head: bytes, reason: str | None) -> None:
    assert pending_reason(head) == reason


@pytest.mark.parametrize("damage", ["checksum", "state", "version"])
def test_a_damaged_header_is_treated_as_holding_data(damage: str) -> None:
    raw = bytearray(render_header(_header(State.SCRUBBED)))
    if damage == "checksum":
        raw[40] ^= 0xFF
    else:  # a valid checksum over a state or version this build does not know
        n = struct.calcsize("<16sIIQQIIIIQQ16s256s")  # the fields the checksum covers (header.py's layout)
        struct.pack_into("<I", raw, 20 if damage == "state" else 16, 7)
        struct.pack_into("<I", raw, n, zlib.crc32(bytes(raw[:n])))
    why = pending_reason(bytes(raw))
    assert why is not None and why.startswith("its memstrata header is unreadable")


def test_methods_discard_only_where_the_device_promises_zeros() -> None:
    assert methods(is_block=True, discard_zeroes_data=False) == ("punch-hole", "zeroout", "write")
    assert methods(is_block=True, discard_zeroes_data=True) == ("discard", "punch-hole", "zeroout", "write")
    assert methods(is_block=False, discard_zeroes_data=True) == ("punch-hole", "write")


def test_scrubbed_header_keeps_the_generation_and_forgets_the_tenant() -> None:
    old = _header(State.OPEN)
    new = scrubbed_header(old, logical_block_size=4096, size=0, now_ns=99)
    assert new.state == State.SCRUBBED and new.owner_job == SCRUBBED_OWNER and new.owner_pid == 0
    assert (new.generation, new.set_id, new.capacity_bytes, new.updated_ns) == (4, old.set_id, GiB, 99)
    assert b"tenant-a" not in render_header(new)
    fresh = scrubbed_header(None, logical_block_size=512, size=DATA_OFFSET + 10 * MiB + 100, now_ns=1)
    assert (fresh.state, fresh.generation, fresh.capacity_bytes) == (State.SCRUBBED, 1, 10 * MiB)
    assert parse_header(render_header(fresh)) == fresh


def test_chunks_and_samples_cover_the_range() -> None:
    assert list(chunks(10, 35, 10)) == [(10, 10), (20, 10), (30, 5)]
    assert list(chunks(5, 5, 10)) == []
    offsets = sample_offsets(4096, 4096 + 1000 * 512, 512, count=8)
    assert offsets[0] == 4096 and offsets[-1] == 4096 + 999 * 512 and len(offsets) == 8
    assert all((o - 4096) % 512 == 0 for o in offsets)
    assert sample_offsets(0, 3 * 512, 512, count=8) == [0, 512, 1024]
    assert sample_offsets(0, 100, 512) == []


def _file_with_data(tmp_path: Path, size: int = 8 * MiB) -> tuple[int, str]:
    path = tmp_path / "stratum.img"
    path.write_bytes(os.urandom(size))
    return os.open(path, os.O_RDWR | os.O_DIRECT), str(path)


def test_zero_range_on_a_file_zeroes_exactly_the_range(tmp_path: Path) -> None:
    fd, path = _file_with_data(tmp_path)
    try:
        before = Path(path).read_bytes()
        assert zero_range(fd, path, MiB, 5 * MiB, block=4096) == "4.0 MiB zeroed by punch-hole"
        after = Path(path).read_bytes()
        assert after[:MiB] == before[:MiB] and after[5 * MiB:] == before[5 * MiB:]
        assert after[MiB:5 * MiB].count(0) == 4 * MiB
        assert zero_range(fd, path, MiB, MiB, block=4096) == "nothing to zero"
        with pytest.raises(ScrubError, match=rf"^{path}: cannot scrub: range \[1000, 8192\) is not aligned"):
            zero_range(fd, path, 1000, 8192, block=4096)
    finally:
        os.close(fd)


def test_zero_range_falls_back_when_a_method_is_not_supported(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def no_holes(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(scrub, "_punch_hole", no_holes)
    fd, path = _file_with_data(tmp_path)
    try:
        assert zero_range(fd, path, 0, 3 * MiB, block=4096) == "3.0 MiB zeroed by write"
        assert Path(path).read_bytes()[:3 * MiB].count(0) == 3 * MiB
    finally:
        os.close(fd)


def test_zero_range_reports_a_failure_and_a_device_that_kept_its_data(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fd, path = _file_with_data(tmp_path)
    try:
        def broken(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(scrub, "_punch_hole", broken)
        with pytest.raises(ScrubError, match=rf"^{path} at offset 0 length {2 * MiB}: cannot scrub: punch-hole "
                                             r"failed \[EIO: Input/output error\]$"):
            zero_range(fd, path, 0, 2 * MiB, block=4096)

        monkeypatch.setattr(scrub, "_punch_hole", lambda fd, offset, length: None)  # says done, did nothing
        with pytest.raises(ScrubError, match=rf"^{path} at offset 0 length 4096: cannot scrub: a block still "
                                             "holds data after zeroing$"):
            zero_range(fd, path, 0, 2 * MiB, block=4096)
    finally:
        os.close(fd)
