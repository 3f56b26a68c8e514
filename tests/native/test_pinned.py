"""The locked pool the swap layer draws from: exact sizes, real mlock accounting, NUMA placement,
trimming, and the RLIMIT_MEMLOCK error."""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import textwrap

import pytest
from native_helpers import child_env

from memstrata.runtime.strata.affinity import Placement
from memstrata.runtime.strata.errors import NumaError
from memstrata.runtime.strata.numa import Policy, memory_nodes, online_nodes
from memstrata.runtime.strata.pinned import ALIGN, LockedPool, vm_locked_bytes

MiB = 1 << 20


def test_buffers_are_exact_and_regions_are_locked_as_the_kernel_counts() -> None:
    before = vm_locked_bytes()
    pool = LockedPool(4 * MiB)
    assert pool.locked_bytes == 0 and vm_locked_bytes() == before  # constructing allocates nothing
    a, b = pool.take(5000), pool.take(10)
    assert (len(a), len(b)) == (5000, 10)
    assert pool.locked_bytes == 4 * MiB and vm_locked_bytes() - before == 4 * MiB  # one region holds both
    assert pool.in_use == 2 * ALIGN + ALIGN  # each rounded up to 4 KiB, never to a power of two
    # Larger than a chunk: a region of exactly its size rounded to 4 KiB (torch would lock 2**27 bytes).
    big = pool.take(77_260_800)
    assert pool.locked_bytes == 4 * MiB + 77_262_848 and vm_locked_bytes() - before == pool.locked_bytes
    for view in (a, b, big):
        pool.free(view)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a)
    pool.close()
    del a, b, big, view
    assert vm_locked_bytes() == before  # unmapping the regions unlocked them


def test_freed_space_is_reused_before_the_pool_grows() -> None:
    pool = LockedPool(MiB)
    first = pool.take(MiB // 2)
    pool.take(MiB // 2)
    pool.free(first)
    again = pool.take(MiB // 4)
    assert pool.locked_bytes == MiB and pool.owns(again) and pool.peak_in_use == MiB


def test_trim_gives_back_idle_regions_only() -> None:
    pool = LockedPool(4 * MiB)
    before = vm_locked_bytes()
    kept = pool.take(4 * MiB)
    kept[:4] = b"keep"
    idle = pool.take(8 * MiB)
    assert vm_locked_bytes() - before == 12 * MiB
    pool.free(idle)
    del idle
    assert pool.trim() == 8 * MiB
    assert pool.locked_bytes == 4 * MiB and vm_locked_bytes() - before == 4 * MiB
    assert bytes(kept[:4]) == b"keep" and pool.trim() == 0  # a live buffer's region is never given back


def test_an_idle_large_region_is_given_back_before_a_larger_one_is_locked() -> None:
    # Sub-groups of slightly different sizes: without this, the update would lock one region per size.
    before = vm_locked_bytes()
    pool = LockedPool(MiB)
    small = pool.take(100)  # a chunk, shared by small buffers
    pool.free(small)
    group = pool.take(3 * MiB)  # a region of its own
    pool.free(group)
    del group
    larger = pool.take(4 * MiB)
    assert pool.locked_bytes == MiB + 4 * MiB and vm_locked_bytes() - before == 5 * MiB
    assert pool.released_bytes == 3 * MiB  # the idle 3 MiB region went; the idle chunk stayed for small buffers
    again = pool.take(100)
    assert pool.locked_bytes == 5 * MiB and pool.owns(again) and pool.owns(larger)


def test_regions_land_on_the_nodes_their_placement_names() -> None:
    node = memory_nodes()[0]
    bound = LockedPool(MiB, placement=Placement((node,), Policy.BIND))
    buf = bound.take(3 * ALIGN)
    assert bound.node_of_pages(buf) == [node] * 3
    spread = LockedPool(MiB, placement=Placement(tuple(memory_nodes()), Policy.INTERLEAVE))
    assert set(spread.node_of_pages(spread.take(MiB))) <= set(memory_nodes())


def test_a_placement_on_a_missing_node_is_refused_by_name() -> None:
    missing = max(online_nodes()) + 7
    pool = LockedPool(MiB, placement=Placement((missing,), Policy.BIND))
    with pytest.raises(NumaError, match=rf"cannot place {MiB} bytes of the locked pool with policy bind on NUMA "
                                        rf"nodes {missing}"):
        pool.take(10)
    assert pool.locked_bytes == 0


LOW_LIMIT_CHILD = textwrap.dedent("""
    from memstrata.runtime.strata.pinned import LockedPool, PinnedMemoryError
    small = LockedPool(256 * 1024)
    kept = small.take(1)  # 256 KiB locked: fits under the limit
    try:
        LockedPool(16 << 20).take(1)
    except PinnedMemoryError as e:
        print(e.needed_bytes, e.limit_bytes, e, sep="\\n")
    else:
        print("locked despite the limit")
""")


def _drop_ipc_lock_and_limit() -> None:
    # Root ignores RLIMIT_MEMLOCK through CAP_IPC_LOCK: drop it from the
    # bounding set so the exec'd child is capped like an unprivileged pod.
    PR_CAPBSET_DROP, CAP_IPC_LOCK = 24, 14
    if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK)")
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))


def test_low_memlock_limit_gives_a_clear_error_with_the_number_needed() -> None:
    proc = subprocess.run([sys.executable, "-c", LOW_LIMIT_CHILD], capture_output=True, text=True, timeout=60,
                          env=child_env(), preexec_fn=_drop_ipc_lock_and_limit)
    assert proc.returncode == 0, proc.stderr
    needed, limit, message = proc.stdout.splitlines()[:3]
    assert int(limit) == 1 << 20
    assert int(needed) == 256 * 1024 + (16 << 20)  # what is already locked + this region
    assert f"RLIMIT_MEMLOCK is {1 << 20} bytes" in message and f"at least {needed} bytes" in message
