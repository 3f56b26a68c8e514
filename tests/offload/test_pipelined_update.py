"""The optimizer update pipelined: read of the next sub-group and write-back of the last during Adam.

Real DeepSpeed ZeRO-3 on gpt-tiny with small sub-groups (9, 8 of them on NVMe) on a loop device, one
process per run (tests/offload/pipeline_worker.py). The pipeline must change nothing the model sees, must
really overlap I/O with Adam, and must leave no read-ahead buffer behind on any path.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from offload_helpers import REPO

pytestmark = [pytest.mark.loopdev, pytest.mark.usefixtures("deepspeed_ready")]

WORKER = Path(__file__).with_name("pipeline_worker.py")
SUB_GROUP = 1 << 16  # elements: gpt-tiny in 9 sub-groups, 8 of them large enough to swap


def _run(dev: str, tmp: Path, name: str, swap: dict[str, Any], steps: int, *extra: str) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(WORKER), dev, str(tmp / f"{name}-swap"), str(out), json.dumps(swap),
                           str(steps), f"sub-group={SUB_GROUP}", *extra],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_read_ahead_changes_no_loss_and_no_weight(loopdev, tmp_path: Path) -> None:
    """Depth 0 (each sub-group read when needed) and depth 1 and 2 train bit for bit alike over steps that
    reverse the order and serve the DRAM cache; every NVMe read after the first of the walk was read ahead."""
    dev = loopdev(512 << 20)
    steps, k = 4, 2
    runs = {d: _run(dev, tmp_path, f"depth{d}", {"prefetch_subgroups": d, "cache_subgroups": k, "checksums": True,
                                                 "overlap_update": True if d == 2 else None}, steps)
            for d in (0, 1, 2)}
    base = runs[0]
    # The update runs in place (memstrata.runtime.swap.overlap), so the walk reverses: by default because the
    # forward runs on the CPU; asked to run beside it, because the 16-bit weights are on NVMe.
    assert not base["overlap"]["on"] and "runs on the CPU" in base["overlap"]["refused"], base["overlap"]
    assert not runs[2]["overlap"]["on"] and "weights on NVMe" in runs[2]["overlap"]["refused"], runs[2]["overlap"]
    assert base["swappable"] > k + 2, base
    assert base["orders"][1] == base["orders"][0][::-1], base["orders"]
    assert base["cache_hits"] == k * (steps - 1)
    for d in (1, 2):
        assert runs[d]["losses"] == base["losses"], d
        assert runs[d]["weights"] == base["weights"], d
        assert runs[d]["cache_hits"] == base["cache_hits"]
    assert base["prefetch_hits"] == [0] * steps
    s = base["swappable"]
    # Step 1 reads every sub-group but the first ahead; later steps start with the K cached ones, whose
    # swap-in already reads the first NVMe one ahead.
    expected = [s - 1] + [s - k] * (steps - 1)
    for d in (1, 2):
        per_step = [b - a for a, b in zip([0] + runs[d]["prefetch_hits"], runs[d]["prefetch_hits"])]
        assert per_step == expected, (d, per_step)


def test_the_next_read_and_the_last_write_run_during_adam(loopdev, tmp_path: Path) -> None:
    r = _run(loopdev(512 << 20), tmp_path, "overlap", {"prefetch_subgroups": 1, "cache_subgroups": 1}, 3)
    adam = r["adam"]

    def spans_adam(t0: float, t1: float) -> bool:  # submitted before an update began, waited after it ended
        return any(t0 < a0 and a1 < t1 for a0, a1 in adam)

    reads = [(t0, t1) for role, t0, t1 in r["io"] if role == "read"]
    writes = [(t0, t1) for role, t0, t1 in r["io"] if role == "write"]
    assert len(reads) == r["prefetch_hits"][-1] > 0
    assert all(spans_adam(*iv) for iv in reads), "a read ahead that no update ran under"
    # Each write-back is waited at the next one, under the next update; only a step's last is drained at the
    # loop's end, with no update after it.
    steps = len(r["losses"])
    assert writes and sum(spans_adam(*iv) for iv in writes) >= len(writes) - steps, "write-backs not behind Adam"


def test_no_read_ahead_buffer_outlives_a_step(loopdev, tmp_path: Path) -> None:
    """After every step, skipped on a non-finite gradient norm (as on an fp16 overflow) or not, the optimizer
    pool holds exactly the cached state."""
    dev = loopdev(512 << 20)
    r = _run(dev, tmp_path, "skip", {"prefetch_subgroups": 2, "cache_subgroups": 1}, 5, "skip-at=3")
    assert r["skipped"] == [False, False, True, False, False], r["skipped"]
    assert r["pool_in_use"] == r["cache_bytes"], r
    # A step that fails in the middle of its walk: the sub-groups read ahead are freed by the step's exit.
    f = _run(dev, tmp_path, "fail", {"prefetch_subgroups": 2, "cache_subgroups": 1}, 3, "fail-at=2")["failure"]
    assert f and f["step"] == 2 and f["reads_in_flight"] == 0, f
    assert f["in_use"] == f["cache"], f


def test_read_ahead_and_write_back_of_one_rank_share_its_token() -> None:
    """Both handles of a rank take the node token; the second takes the rank's own hold, never waits for it,
    and the token is free for a peer once both have waited."""
    torch = pytest.importorskip("torch")
    from memstrata.runtime.strata.nvme import NvmeEngine
    from memstrata.runtime.strata.pinned import LockedPool
    from memstrata.runtime.swap.handle import ExtentSwapHandle, SwapCounters
    from memstrata.runtime.swap.tokens import IoTokens

    stratum = f"test-{uuid.uuid4().hex[:8]}"
    tokens, peer = IoTokens(stratum, 1, rank=0), IoTokens(stratum, 1, rank=1)
    path = Path(f"/tmp/{stratum}.img")
    path.write_bytes(b"")
    os.truncate(path, 16 << 20)
    try:
        with NvmeEngine.open([str(path)], job="token-share") as engine:
            pool, counters = LockedPool(4 << 20, lock=False), SwapCounters()
            reader, writer = (ExtentSwapHandle(engine, pool, counters, kind="optimizer", tokens=tokens)
                              for _ in range(2))
            a, b = pool.tensor(1 << 16, torch.float32).normal_(), pool.tensor(1 << 16, torch.float32)
            writer.async_pwrite(a, "x")
            writer.wait()
            writer.async_pwrite(a, "y")  # write-back in flight ...
            reader.async_pread(b, "x")  # ... while the read-ahead is submitted: must not block
            assert tokens.held and peer.acquire(timeout_s=0.05) is False
            reader.wait()
            assert tokens.held, "the write-back's hold went with the read's"
            writer.wait()
            assert not tokens.held and peer.acquire(timeout_s=1.0) is True
            peer.release()
            assert torch.equal(a, b)
    finally:
        tokens.close(), peer.close()
        path.unlink()
        for f in Path("/dev/shm").glob(f"memstrata-io-{stratum}-*"):
            f.unlink()
