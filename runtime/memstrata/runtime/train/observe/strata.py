"""Per step, what each stratum holds and what moved between them: the numbers TensorBoard plots beside the loss.

The run's cumulative counters (the per-stratum bytes the job's status carries, the recipe's phase times, the swap
layer's own counters) are read once per step; a step's numbers are the differences from the previous step's
reading, so they add up to the run's totals. A reading is taken after the step's evaluation, checkpoint and
exports, so the bytes between two readings include theirs; bandwidths are those bytes over the wall time between the
two readings (`time/interval_seconds`, at least the step's own `time/step_seconds`).
"""
from __future__ import annotations

from collections.abc import Mapping
import time
from dataclasses import dataclass, field

from memstrata.api.report import StratumCounters
from memstrata.runtime.swap.status import SwapStatus
from memstrata.runtime.train.observe.metrics import Phases


@dataclass(frozen=True)
class Reading:
    """The cumulative counters at the end of one step."""

    moved: Mapping[str, tuple[int, int]]  # stratum -> (bytes written to it, bytes read from it), since the start
    phases: tuple[float, float, float]  # forward, backward, update seconds on the main thread, since the start
    swap: Mapping[str, float] = field(default_factory=dict)  # the swap layer's cumulative counters (memstrata)
    at: float = 0.0  # time.perf_counter() when it was read


def read_counters(strata: Mapping[str, StratumCounters], phases: Phases, swap: SwapStatus | None) -> Reading:
    return Reading(moved={k: (v.bytes_written, v.bytes_read) for k, v in strata.items()},
                   phases=(phases.forward, phases.backward, phases.step), swap=_swap_counters(swap),
                   at=time.perf_counter())


def _swap_counters(swap: SwapStatus | None) -> dict[str, float]:
    if swap is None:
        return {}
    o = swap.update_overlap
    return {"prefetch_hits": swap.dram.prefetch_hits, "optimizer_cache_hits": swap.dram.optimizer_cache_hits,
            "io_token_wait_seconds": swap.nvme.io_token_wait_seconds,
            "forward_wait_seconds": o.forward_wait_seconds, "overlapped_update_seconds": o.update_seconds}


def held_bytes(rss: int, hbm: int | None, swap: SwapStatus | None, swap_dir_bytes: int) -> dict[str, int]:
    """What each stratum holds now: device memory in use, the process tree's resident set (less what of it lies
    on CXL nodes), the activation pool on CXL nodes, the state on NVMe (memstrata's live extents; the stock
    engine's swap files)."""
    act = swap.activations if swap is not None else None
    cxl = act.locked_bytes if act is not None and act.stratum == "cxl" else 0
    held = {"dram": max(0, rss - cxl), "nvme": swap.nvme.bytes_live if swap is not None else swap_dir_bytes}
    if cxl:
        held["cxl"] = cxl
    if hbm is not None:
        held["hbm"] = hbm
    return held


def step_scalars(before: Reading, after: Reading, seconds: float, held: Mapping[str, int]) -> dict[str, float]:
    """One step's scalars, by TensorBoard tag."""
    out: dict[str, float] = {f"strata/{k}_held_bytes": float(v) for k, v in sorted(held.items())}
    interval = after.at - before.at
    for stratum, (written, read) in sorted(after.moved.items()):
        w0, r0 = before.moved.get(stratum, (0, 0))
        for direction, n in (("written", written - w0), ("read", read - r0)):
            out[f"io/{stratum}_{direction}_bytes"] = float(n)
            if interval > 0:
                out[f"io/{stratum}_{direction}_bytes_per_second"] = n / interval
    for name, now, then in zip(("forward", "backward", "update"), after.phases, before.phases):
        out[f"time/{name}_seconds"] = now - then
    out["time/step_seconds"] = seconds
    out["time/interval_seconds"] = interval
    for name, now in sorted(after.swap.items()):
        out[f"swap/{name}"] = now - before.swap.get(name, 0.0)
    return out


class StepStrata:
    """Keeps the previous step's reading; `step()` gives each step's scalars."""

    def __init__(self, start: Reading) -> None:
        self.last = start

    def step(self, now: Reading, seconds: float, held: Mapping[str, int]) -> dict[str, float]:
        scalars = step_scalars(self.last, now, seconds, held)
        self.last = now
        return scalars
