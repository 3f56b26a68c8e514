"""The swap handle on a real loop device: what is read back is what was written, or a clear error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from offload_helpers import REPO

torch = pytest.importorskip("torch", reason="torch is needed for the swap layer (run the tests with the venv)")

from memstrata.runtime.strata.nvme import NvmeEngine  # noqa: E402
from memstrata.runtime.strata.pinned import LockedPool, vm_locked_bytes  # noqa: E402
from memstrata.runtime.swap.handle import ExtentSwapHandle, SwapCounters, SwapError  # noqa: E402
from memstrata.runtime.strata.affinity import TensorKind  # noqa: E402
from memstrata.runtime.swap.layer import SwapSettings, locked_pool  # noqa: E402
from memstrata.runtime.swap.tokens import IoTokens  # noqa: E402

pytestmark = pytest.mark.loopdev


def _handle(engine: NvmeEngine, checksums: dict[str, str] | None, root: Path) -> tuple[ExtentSwapHandle,
                                                                                        LockedPool]:
    pool = LockedPool(4 << 20)
    return ExtentSwapHandle(engine, pool, SwapCounters(), kind="optimizer", tokens=IoTokens("t-handle", 1, root=root),
                            checksums=checksums), pool


def test_round_trip_of_optimizer_state_is_checksummed(loopdev, tmp_path: Path) -> None:
    devs = [loopdev(64 << 20), loopdev(64 << 20)]
    with NvmeEngine.open(devs, job="test-swap", stripe_bytes=1 << 20) as engine:
        sums: dict[str, str] = {}
        h, pool = _handle(engine, sums, tmp_path)
        tensors = {f"t{i}": torch.randn(n) for i, n in enumerate([1, 1023, 262_144 + 7, 3 << 20])}
        tensors["bf16"] = torch.randn(999_999).to(torch.bfloat16)
        pinned = pool.tensor(500_000, torch.float32).copy_(torch.randn(500_000))
        tensors["pinned"] = pinned
        for name, t in tensors.items():
            h.async_pwrite(t, name)
        assert h.wait() == len(tensors)
        back = {name: torch.empty_like(t) for name, t in tensors.items()}
        for name, t in back.items():
            h.async_pread(t, name)
        assert h.wait() == len(tensors)
        for name in tensors:
            assert torch.equal(tensors[name], back[name]), name
        assert set(sums) == set(tensors)
        # The big tensor was striped: both namespaces carry bytes.
        assert all(s.bytes_written > 0 for s in engine.stats())
        assert h.counters.bytes_written == sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_changed_extent_is_caught_on_read(loopdev, tmp_path: Path) -> None:
    with NvmeEngine.open([loopdev(16 << 20)], job="test-swap") as engine:
        h, _ = _handle(engine, {}, tmp_path)
        h.async_pwrite(torch.arange(4096, dtype=torch.float32), "state")
        h.wait()
        # Overwrite the extent behind the handle's back: the read must not pass silently.
        extent = engine._memstrata_names["state"]
        engine.wait(engine.write(extent, torch.zeros(4096, dtype=torch.float32)))
        h.async_pread(torch.empty(4096), "state")
        with pytest.raises(SwapError, match="state: data read back differs"):
            h.wait()


def test_reading_a_never_written_tensor_names_it(loopdev, tmp_path: Path) -> None:
    with NvmeEngine.open([loopdev(16 << 20)], job="test-swap") as engine:
        h, _ = _handle(engine, None, tmp_path)
        with pytest.raises(SwapError, match="exp_avg-7: read of a tensor that was never written"):
            h.async_pread(torch.empty(10), "exp_avg-7")


def test_importing_the_runtime_does_not_import_torch() -> None:
    code = "import sys, memstrata.runtime as r; assert callable(r.__getattr__); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_trim_gives_back_idle_locked_regions_only() -> None:
    """After an update the pool unmaps what nothing uses: the kernel's locked count falls, live buffers stay."""
    pool = LockedPool(4 << 20)
    before = vm_locked_bytes()
    kept = pool.tensor(1 << 20, torch.float32)  # 4 MiB: a region of its own
    kept.fill_(3.0)
    idle = pool.tensor(2 << 20, torch.float32)  # 8 MiB: another
    assert vm_locked_bytes() - before == 12 << 20
    pool.free(idle)
    del idle
    assert pool.trim() == 8 << 20
    assert pool.locked_bytes == 4 << 20 and vm_locked_bytes() - before == 4 << 20
    assert bool((kept == 3.0).all()) and pool.owns(kept)
    assert pool.trim() == 0  # the live buffer's region is never given back
    again = pool.tensor(1024, torch.float32)  # the pool grows again after a trim
    assert pool.owns(again)
    pool.free(again)
    pool.free(kept)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(kept)


def test_deepspeeds_locked_buffers_come_exactly_from_the_swap_layers_pools(loopdev, tmp_path: Path) -> None:
    """What DeepSpeed's swappers ask the handle for is carved from the pools SwapLayer builds: exact, locked,
    optimizer operands bound to DRAM beside CXL, and no binding at all on a node with one memory node."""
    beside_cxl = SwapSettings(pool_chunk_bytes=2 << 20, dram_nodes=[0], cxl_nodes=[1])
    optimizer_pool, param_pool, weights_pool, activation_pool = (locked_pool(beside_cxl, kind) for kind in TensorKind)
    assert optimizer_pool.placement is not None and optimizer_pool.placement.nodes == (0,)
    assert param_pool.placement is not None and param_pool.placement.nodes == (1,)  # DMA-only: on CXL
    assert weights_pool.placement is not None and weights_pool.placement.nodes == (1,)
    assert activation_pool.placement is not None and activation_pool.placement.nodes == (1,)
    alone = SwapSettings(pool_chunk_bytes=2 << 20, dram_nodes=[0])
    optimizer_pool, param_pool = locked_pool(alone, TensorKind.OPTIMIZER), locked_pool(alone, TensorKind.PARAM_STAGING)
    # One memory node: nothing to choose, so no mbind (a container's default seccomp profile refuses it).
    assert optimizer_pool.placement is not None and optimizer_pool.placement.nodes == ()
    assert param_pool.placement is not None and param_pool.placement.nodes == ()
    before = vm_locked_bytes()
    with NvmeEngine.open([loopdev(16 << 20)], job="test-swap") as engine:
        h = ExtentSwapHandle(engine, optimizer_pool, SwapCounters(), kind="optimizer")
        buf = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.bfloat16))
        assert buf.dtype == torch.bfloat16 and buf.numel() == 1000 and h.is_pinned(buf)
        assert not h.is_pinned(torch.empty(1000, dtype=torch.bfloat16))
        assert vm_locked_bytes() - before == optimizer_pool.locked_bytes == 2 << 20
        assert optimizer_pool.node_of_pages(buf) == [0]
        assert h.free_cpu_locked_tensor(buf) and optimizer_pool.in_use == 0
