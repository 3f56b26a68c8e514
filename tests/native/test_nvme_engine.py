"""The raw-NVMe engine on real loop devices (direct I/O) and on plain files."""
from __future__ import annotations

import os
import random

import pytest

from memstrata.runtime import _native
from memstrata.node.header import DATA_OFFSET, State, parse_header
from memstrata.runtime.strata.nvme import NvmeEngine
from memstrata.node.safety import read_head

MiB = 1 << 20
AWKWARD = [1, 511, 512, 513, 4095, 4097, MiB - 1, MiB + 3, 3 * MiB + 1234, 5 * MiB]


def test_round_trip_awkward_sizes_from_unaligned_and_aligned_buffers(devices) -> None:
    rng = random.Random(3)
    with NvmeEngine.open(devices(1, 64 * MiB), job="t/round-trip", queue_depth=4) as eng:
        for size in AWKWARD:
            for shift in (0, 1):  # shift 1: the source is not aligned, so it goes via a bounce region
                ext = eng.allocate(size)
                src = bytearray(rng.randbytes(size + shift))
                eng.wait(eng.write(ext, memoryview(src)[shift:]))
                out = bytearray(size + 3)
                eng.wait(eng.read(ext, memoryview(out)[3:]))
                assert out[3:] == src[shift:], (size, shift)
                eng.free(ext)
        st = eng.stats()[0]
        assert st.space.free_bytes == st.space.capacity_bytes and st.errors == 0
        assert st.bytes_written >= sum(AWKWARD) * 2


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int64", "complex64"])
def test_round_trip_numpy_arrays_of_awkward_shapes(devices, dtype: str) -> None:
    np = pytest.importorskip("numpy", reason="numpy is part of the runtime extra (the venv has it)")
    rng = np.random.default_rng(7)
    with NvmeEngine.open(devices(1, 64 * MiB), job="t/numpy") as eng:
        for shape in [(1,), (3, 5, 7), (1023, 17), (257, 1031)]:
            a = (rng.standard_normal(shape) * 100).astype(dtype)
            ext = eng.allocate(a.nbytes)
            eng.wait(eng.write(ext, a))
            b = np.empty_like(a)
            eng.wait(eng.read(ext, b))
            assert np.array_equal(a, b)


def test_round_trip_torch_tensors_including_bfloat16(devices) -> None:
    torch = pytest.importorskip("torch", reason="torch is part of the runtime extra (the venv has it)")
    with NvmeEngine.open(devices(1, 64 * MiB), job="t/torch") as eng:
        for dtype, shape in [(torch.bfloat16, (4097,)), (torch.float16, (33, 65)), (torch.float32, (1000, 333))]:
            t = torch.randn(shape).to(dtype)
            ext = eng.allocate(t.numel() * t.element_size())
            eng.wait(eng.write(ext, t))
            back = torch.empty_like(t)
            eng.wait(eng.read(ext, back))
            assert torch.equal(t, back)


@pytest.mark.parametrize("ndev", [2, 3, 4])
def test_striping_spreads_one_tensor_over_every_device(devices, ndev: int) -> None:
    stripe = 256 * 1024
    paths = devices(ndev, 32 * MiB)
    size = 10 * stripe + 777
    data = random.Random(ndev).randbytes(size)
    with NvmeEngine.open(paths, job="t/stripe", stripe_bytes=stripe, queue_depth=16) as eng:
        ext = eng.allocate(size)
        assert ext.slots == tuple(range(ndev))
        eng.wait(eng.write(ext, data))
        out = bytearray(size)
        eng.wait(eng.read(ext, out))
        assert out == data
        written = [s.bytes_written for s in eng.stats()]
        assert all(w >= stripe for w in written) and sum(written) == ext.padded
        # The bytes are really on the devices, in round-robin stripe order (while open: close zeroes them).
        for k in range(10):
            dev, row = k % ndev, k // ndev
            with open(paths[dev], "rb") as f:
                f.seek(ext.bases[dev] + row * stripe)
                assert f.read(stripe) == data[k * stripe : (k + 1) * stripe], (k, dev)


@pytest.mark.parametrize("ndev", [1, 3])
def test_parts_of_a_striped_extent_read_and_write_only_their_bytes(devices, ndev: int) -> None:
    """A slice of a tensor (memstrata.runtime.swap.sliced) moves through a part of its extent: parts that start
    and end mid stripe unit, across several units, and the short tail, read back exactly what a whole write put
    there, and a part's write changes no byte outside it."""
    from memstrata.runtime.strata.nvmeio import part_of

    stripe = 64 * 1024
    size = 10 * stripe + 777
    rng = random.Random(ndev)
    data = bytearray(rng.randbytes(size))
    with NvmeEngine.open(devices(ndev, 16 * MiB), job="t/parts", stripe_bytes=stripe, queue_depth=8) as eng:
        ext = eng.allocate(size)
        eng.wait(eng.write(ext, data))
        for off, n in [(0, 4096), (4096, stripe), (3 * 4096, 2 * stripe + 8192), (9 * stripe, size - 9 * stripe)]:
            out = bytearray(n)
            eng.wait(eng.read(part_of(ext, off, n), out))
            assert out == data[off:off + n], (off, n)
            fresh = rng.randbytes(n)
            eng.wait(eng.write(part_of(ext, off, n), fresh))
            data[off:off + n] = fresh
        whole = bytearray(size)
        eng.wait(eng.read(ext, whole))
        assert whole == data
        for off, n, why in [(100, 4096, "block size"), (size - 10, 4096, "outside"), (0, 0, "outside")]:
            with pytest.raises(ValueError, match=why):
                part_of(ext, off, n)
        with pytest.raises(ValueError, match="not live"):
            eng.free(part_of(ext, 0, 4096))  # only the allocated extent is freed
        eng.free(ext)
        assert eng.stats()[0].space.free_bytes == eng.stats()[0].space.capacity_bytes


def test_registered_arena_uses_fixed_buffers_and_header_tracks_state(devices) -> None:
    paths = devices(1, 16 * MiB)
    with NvmeEngine.open(paths, job="t/fixed", max_io_bytes=MiB) as eng:
        arena = _native.Region(4 * MiB)
        eng.register_buffers([arena])
        view = memoryview(arena)
        view[:] = random.Random(0).randbytes(4 * MiB)
        ext = eng.allocate(4 * MiB)
        eng.wait(eng.write(ext, view))
        view[:] = bytes(4 * MiB)
        eng.wait(eng.read(ext, view))
        assert eng.stats()[0].fixed_buffer_ios == 8
        assert bytes(view[:16]) == random.Random(0).randbytes(16)
        on_disk = parse_header(read_head(paths[0], 4096))
        assert on_disk is not None and on_disk.state == State.OPEN and on_disk.owner_job == "t/fixed"
        assert on_disk.owner_pid == os.getpid() and ext.bases[0] >= DATA_OFFSET
        view.release()
    closed = parse_header(read_head(paths[0], 4096))
    assert closed is not None and closed.state == State.SCRUBBED and closed.generation == on_disk.generation


def test_many_handles_in_flight_beyond_queue_depth(devices) -> None:
    with NvmeEngine.open(devices(1, 64 * MiB), job="t/depth", queue_depth=2, max_io_bytes=64 * 1024) as eng:
        blobs = [random.Random(i).randbytes(300_000 + i) for i in range(12)]
        exts = [eng.allocate(len(b)) for b in blobs]
        handles = [eng.write(e, b) for e, b in zip(exts, blobs)]
        eng.wait_all()
        assert all(h.done and h.error is None for h in handles)
        outs = [bytearray(len(b)) for b in blobs]
        for h in [eng.read(e, o) for e, o in zip(exts, outs)]:
            eng.wait(h)
        assert outs == [bytearray(b) for b in blobs]
        with pytest.raises(ValueError, match="buffer has 3 bytes"):
            eng.write(exts[0], b"abc")
