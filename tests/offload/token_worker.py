"""One rank of the 2-rank I/O-token test: swap I/O on its own namespace, under the node's shared token.

    python token_worker.py RANK WORLD PORT DEVICE STRATUM LIMIT OUT
Writes OUT (JSON): the (start, end) CLOCK_MONOTONIC interval of every I/O batch it ran.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from memstrata.runtime.strata.nvme import NvmeEngine
from memstrata.runtime.strata.pinned import LockedPool
from memstrata.runtime.swap.handle import ExtentSwapHandle, SwapCounters
from memstrata.runtime.swap.tokens import IoTokens


def main() -> None:
    rank, world, port, device, stratum, limit, out = sys.argv[1:8]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world))
    intervals: list[tuple[float, float]] = []
    tokens = IoTokens(stratum, int(limit), rank=int(rank))
    with NvmeEngine.open([device], job=f"token-test-{rank}") as engine:
        pool = LockedPool(16 << 20)
        h = ExtentSwapHandle(engine, pool, SwapCounters(), kind="optimizer", tokens=tokens)
        h.on_io = lambda _k, t0, t1: intervals.append((t0, t1))
        state = pool.tensor(2 << 20, torch.float32).normal_()
        back = pool.tensor(2 << 20, torch.float32)
        dist.barrier()  # both ranks start their I/O together
        for i in range(12):
            h.async_pwrite(state, f"state-{i % 3}")
            h.wait()
            h.async_pread(back, f"state-{i % 3}")
            h.wait()
        dist.barrier()
    Path(out).write_text(json.dumps({"rank": int(rank), "intervals": intervals, "wait_s": tokens.wait_seconds}))
    tokens.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
