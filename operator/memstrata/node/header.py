"""The memstrata header at the start of every device the NVMe engine owns.

Pure: no I/O and no native import, because discovery (the node agent) reads
the first blocks of a namespace itself and must recognise this header as
memstrata's own, not as a foreign filesystem it has to protect.

Layout (little-endian, HEADER_BYTES long, zero padded, CRC32 over the fields):
magic 16s | version u32 | state u32 | generation u64 | updated_ns u64 |
owner_pid u32 | set_index u32 | set_size u32 | logical_block_size u32 |
capacity_bytes u64 | data_offset u64 | set_id 16s | owner_job 256s | crc32 u32

The state says whether the last owner's data may still be on the device: only
SCRUBBED promises it is not (memstrata.node.scrub holds the rule built on that).
SCRUBBED came later than CLOSED and OPEN, in the same format version: headers an
older build wrote read as before, and all of them as not scrubbed.
"""
from __future__ import annotations

import struct
import uuid
import zlib
from dataclasses import dataclass
from enum import IntEnum

MAGIC = b"memstrata-nvme\x00\x01"
VERSION = 1
# One 4 KiB block: the largest logical block size in use, so the header
# write is a single aligned O_DIRECT write on any device.
HEADER_BYTES = 4096
# Data starts at 1 MiB so every extent is aligned for any block size.
DATA_OFFSET = 1 << 20
MAX_JOB_BYTES = 256

_FIELDS = struct.Struct("<16sIIQQIIIIQQ16s256s")
_CRC = struct.Struct("<I")


class HeaderError(ValueError):
    """Bytes that carry memstrata's magic but cannot be read as a header."""


class State(IntEnum):
    # Closed by a build that did not scrub: the owner's data is still there. Never written any more;
    # kept so that such headers read as dirty rather than as damaged.
    CLOSED = 0
    OPEN = 1  # an engine has it, or had it and died: its data may be anywhere in the data area
    SCRUBBED = 2  # every byte the last owner may have written reads back as zero; safe to offer again


@dataclass(frozen=True)
class Header:
    owner_job: str
    generation: int
    state: State
    set_id: uuid.UUID
    set_index: int
    set_size: int
    logical_block_size: int
    capacity_bytes: int
    data_offset: int = DATA_OFFSET
    owner_pid: int = 0
    updated_ns: int = 0
    version: int = VERSION


def is_memstrata(head: bytes) -> bool:
    """True when `head` starts with memstrata's magic (valid or not)."""
    return head[: len(MAGIC)] == MAGIC


def render_header(header: Header) -> bytes:
    """The HEADER_BYTES on-device form of `header`."""
    job = header.owner_job.encode("utf-8")
    if not job or len(job) > MAX_JOB_BYTES:
        raise HeaderError(f"owner_job must be 1..{MAX_JOB_BYTES} UTF-8 bytes, got {len(job)}")
    if not 0 <= header.set_index < header.set_size:
        raise HeaderError(f"set_index {header.set_index} outside a set of {header.set_size}")
    fields = _FIELDS.pack(
        MAGIC,
        header.version,
        int(header.state),
        header.generation,
        header.updated_ns,
        header.owner_pid,
        header.set_index,
        header.set_size,
        header.logical_block_size,
        header.capacity_bytes,
        header.data_offset,
        header.set_id.bytes,
        job,
    )
    body = fields + _CRC.pack(zlib.crc32(fields))
    return body + bytes(HEADER_BYTES - len(body))


def parse_header(data: bytes) -> Header | None:
    """The header in `data`, None when `data` does not start with memstrata's magic.

    Raises HeaderError when the magic is there but the rest is damaged or from
    an unknown version: the device is still memstrata's, its content is not usable.
    """
    if not is_memstrata(data):
        return None
    need = _FIELDS.size + _CRC.size
    if len(data) < need:
        raise HeaderError(f"memstrata header truncated: {len(data)} of {need} bytes")
    fields = bytes(data[: _FIELDS.size])
    (crc,) = _CRC.unpack_from(data, _FIELDS.size)
    if zlib.crc32(fields) != crc:
        raise HeaderError("memstrata header checksum mismatch")
    (_, version, state, generation, updated_ns, pid, index, size, lbs, capacity, data_offset, set_id, job) = (
        _FIELDS.unpack(fields)
    )
    if version != VERSION:
        raise HeaderError(f"memstrata header version {version}, this build reads {VERSION}")
    try:
        state_v = State(state)
    except ValueError:
        raise HeaderError(f"memstrata header has unknown state {state}") from None
    return Header(
        owner_job=job.rstrip(b"\x00").decode("utf-8", errors="replace"),
        generation=generation,
        state=state_v,
        set_id=uuid.UUID(bytes=set_id),
        set_index=index,
        set_size=size,
        logical_block_size=lbs,
        capacity_bytes=capacity,
        data_offset=data_offset,
        owner_pid=pid,
        updated_ns=updated_ns,
        version=version,
    )
