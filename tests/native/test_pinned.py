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


def test_a_zero_element_tensor_round_trips() -> None:
    """torch's non-reentrant checkpoint (up to 2.12) saves a zero-element tensor per layer; its data pointer reads 0
    wherever it lies, so a pool keyed by data pointers could never take it back."""
    import torch

    pool = LockedPool(MiB)
    empty = pool.tensor(0, torch.float32)
    assert empty.numel() == 0 and empty.data_ptr() == 0 and pool.owns(empty) and pool.in_use == ALIGN
    pool.free(empty)
    assert pool.in_use == 0
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(empty)
    view = pool.tensor(1024, torch.float32)[256:]  # a view inside a buffer frees the buffer
    pool.free(view)
    assert pool.in_use == 0



def test_buffers_are_host_tensors_of_the_asked_dtype_wherever_new_tensors_are_being_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a model is built zero.Init makes every new tensor on the accelerator and casts floating ones to its own
    dtype (the first GPU run of memstrata's engine failed there: a pool buffer set up on a GPU tensor). Stood in
    for here by what it does to torch.empty. (Not with torch.device() as well: its context caches the constructors
    it sees first, and would keep this stand-in for the rest of the process.)"""
    import torch

    real = torch.empty

    def as_zero_init_makes_them(*args: object, **kwargs: object) -> object:
        floating = kwargs.get("dtype", torch.float32).is_floating_point  # type: ignore[union-attr]
        return real(*args, **{**kwargs, "device": "meta", **({"dtype": torch.bfloat16} if floating else {})})

    monkeypatch.setattr(torch, "empty", as_zero_init_makes_them)
    pool = LockedPool(MiB)
    t = pool.tensor(256, torch.float32)
    empty = pool.tensor(0, torch.float32)
    assert torch.empty(1).device.type == "meta"  # the stand-in is in force
    assert t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() == 256 and pool.owns(t)
    assert t._base is None and empty.numel() == 0 and empty.dtype == torch.float32  # tensors of their own
    pool.free(t)
    pool.free(empty)
    assert pool.in_use == 0


class _Copies:
    """A DMA device standing in for a GPU: it counts registrations, and each fence stays open until the test says
    the copies queued before it have run."""

    name = "fake:0"

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.registrations = self.unregistrations = 0
        self.open: list[list[bool]] = []
        self.fenced_streams: list[tuple[object, ...]] = []

    def register(self, address: int, size: int) -> None:
        assert address not in self.registered, "a region registered twice"
        self.registered[address] = size
        self.registrations += 1

    def unregister(self, address: int) -> None:
        del self.registered[address]
        self.unregistrations += 1

    def current_stream(self) -> object:
        return "current"

    def fence(self, streams: tuple[object, ...] = ()) -> "_Fence":
        state = [False]
        self.open.append(state)
        self.fenced_streams.append(tuple(streams))
        return _Fence(state)

    def copies_ran(self) -> None:
        for state in self.open:
            state[0] = True


class _Fence:
    def __init__(self, state: list[bool]) -> None:
        self.state = state

    def done(self) -> bool:
        return self.state[0]

    def wait(self) -> None:
        self.state[0] = True  # the host waits until the copies have run


def test_a_freed_buffer_is_reused_only_after_the_copies_reading_it_have_run() -> None:
    """Registered with a GPU, a pool's buffers are copied by DMA while the host goes on: one given back while its
    copy still runs must not be handed out again, or the next fill overwrites what the GPU is reading."""
    dma = _Copies()
    pool = LockedPool(MiB, lock=False, dma=dma)
    first = pool.take(MiB // 2)
    pool.take(MiB // 2)
    assert dma.registrations == 1 and dma.registered == {pool._regions[0][0].address: MiB}
    pool.free(first, streams=("side",))
    assert dma.fenced_streams == [("side",)]
    assert pool.in_use == MiB  # its copy has not run: still in use
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(first)
    dma.copies_ran()
    assert pool.in_use == MiB // 2  # now it is back
    again = pool.take(MiB // 2)  # and reused, with no new region
    assert pool.locked_bytes == MiB and dma.registrations == 1 and pool.owns(again)


def test_a_pool_waits_for_pending_copies_before_it_grows_and_unregisters_what_it_gives_back() -> None:
    dma = _Copies()
    pool = LockedPool(MiB, lock=False, dma=dma)
    whole = pool.take(MiB)
    pool.free(whole)
    again = pool.take(MiB)  # no room unless the fenced free is waited for: the pool waits rather than grow
    assert pool.locked_bytes == MiB and dma.registrations == 1 and pool.owns(again)
    big = pool.take(3 * MiB)
    assert dma.registrations == 2
    pool.free(big)
    dma.copies_ran()
    assert pool.trim() == 3 * MiB and dma.unregistrations == 1  # given back: unregistered first
    pool.free(again)
    pool.close()  # waits for the last copies, then unregisters every region left
    assert dma.registered == {} and dma.unregistrations == 2 and all(state[0] for state in dma.open)


def test_a_reserved_region_is_registered_once_and_outlives_trim() -> None:
    """The update's buffers are carved from one region locked once (`reserve`): on a GPU it is registered once,
    exactly its size; its freed buffers wait for their copies like any other; trim gives back only what grew beyond
    it, and close unregisters it last."""
    dma = _Copies()
    pool = LockedPool(MiB, lock=False, dma=dma)
    assert pool.reserve(3 * MiB + 1) == 3 * MiB + 4096 and pool.locked_bytes == 3 * MiB + 4096
    assert dma.registrations == 1 and list(dma.registered.values()) == [3 * MiB + 4096]
    a, b = pool.take(MiB), pool.take(2 * MiB)  # both inside the reserved region: nothing more registered
    extra = pool.take(MiB)  # beyond it: a chunk of its own
    assert dma.registrations == 2 and pool.locked_bytes == 4 * MiB + 4096
    for t in (a, b, extra):
        pool.free(t)
    assert pool.in_use == 4 * MiB  # freed with copies pending: not reusable yet
    dma.copies_ran()
    assert pool.trim() == MiB and dma.unregistrations == 1  # the chunk goes; the reserved region stays
    assert pool.locked_bytes == 3 * MiB + 4096 and pool.owns(pool.take(3 * MiB)) and dma.registrations == 2
    pool.close()
    assert dma.registered == {} and dma.unregistrations == 2


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU: registration and DMA")
def test_on_a_gpu_a_freed_buffer_is_not_refilled_while_its_copy_to_the_device_waits() -> None:
    """A registered buffer is copied by the GPU's DMA after the host has moved on: here the copy waits behind a
    long kernel, the buffer is freed and a new one taken and overwritten at once. Unfenced, the new one would be
    the same memory and the device would receive the overwrite."""
    import torch

    from memstrata.runtime.strata.dma import CudaDma

    device = torch.device("cuda", torch.cuda.current_device())
    pool = LockedPool(32 * MiB, lock=False, dma=CudaDma(device))  # one region, room for one buffer
    first = pool.tensor(8 << 20, torch.float32).fill_(1.0)  # 32 MiB
    where = first.untyped_storage().data_ptr()
    assert first.is_pinned() and pool.registrations == 1  # registered: the copy below is real DMA
    on_device = torch.empty_like(first, device=device)
    torch.cuda._sleep(1 << 30)  # the copy queues behind about a second of work
    on_device.copy_(first, non_blocking=True)
    pool.free(first)
    second = pool.tensor(8 << 20, torch.float32)
    assert second.untyped_storage().data_ptr() == where  # the same memory: the pool waited for the copy first
    second.fill_(2.0)
    torch.cuda.synchronize()
    assert bool((on_device == 1.0).all())
    pool.close()
