"""The extent allocator: reuse, coalescing and fragmentation statistics (pure)."""
from __future__ import annotations

import random

import pytest

from memstrata.runtime.strata.extents import ExtentAllocator, ExtentError, per_device_bytes, stripe_chunks

MiB = 1 << 20


def test_free_space_coalesces_back_to_one_extent() -> None:
    a = ExtentAllocator(MiB, 64 * MiB, 4096)
    offs = [a.allocate(random.Random(i).randint(1, 3 * MiB))[0] for i in range(20)]
    random.Random(1).shuffle(offs)
    for off in offs:
        a.free(off)
    st = a.stats()
    assert (st.free_bytes, st.free_extents, st.largest_free_bytes, st.fragmentation) == (64 * MiB, 1, 64 * MiB, 0.0)


def test_sizes_round_to_block_and_holes_are_reused_best_fit() -> None:
    a = ExtentAllocator(0, 16 * MiB, 512)
    assert a.allocate(1) == (0, 512)
    x, _ = a.allocate(MiB)
    a.allocate(MiB)  # keeps the two holes apart
    y, _ = a.allocate(2 * MiB)
    a.allocate(MiB)
    a.free(x)
    a.free(y)
    st = a.stats()
    assert st.free_extents == 3 and 0 < st.fragmentation < 1
    # 1 MiB fits the 1 MiB hole exactly (best fit), not the 2 MiB one or the tail.
    assert a.allocate(MiB)[0] == x
    assert a.allocate(2 * MiB)[0] == y


def test_fragmentation_blocks_a_large_allocation_that_total_free_space_would_fit() -> None:
    a = ExtentAllocator(0, 8 * MiB, 4096)
    offs = [a.allocate(MiB)[0] for _ in range(8)]
    for off in offs[::2]:
        a.free(off)
    st = a.stats()
    assert st.free_bytes == 4 * MiB and st.largest_free_bytes == MiB and st.fragmentation == 0.75
    with pytest.raises(ExtentError, match="largest free extent 1048576") as info:
        a.allocate(2 * MiB)
    assert info.value.no_space
    with pytest.raises(ExtentError, match="double free"):
        a.free(offs[0])


def test_stripe_map_covers_every_byte_once_round_robin() -> None:
    chunks = list(stripe_chunks(10 * MiB + 4096, MiB, 3))
    assert sum(c.length for c in chunks) == 10 * MiB + 4096
    assert [c.slot for c in chunks[:4]] == [0, 1, 2, 0]
    assert chunks[3].device_offset == MiB
    assert per_device_bytes(10 * MiB + 4096, MiB, 3) == [4 * MiB, 3 * MiB + 4096, 3 * MiB]
