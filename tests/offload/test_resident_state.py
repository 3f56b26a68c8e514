"""The DRAM budget as a continuum inside real ZeRO-3 training: the sub-groups the budget holds stay in DRAM for
good (no NVMe extent, no byte moved), the rest stream, the numbers are the same, and a budget that holds
everything runs with no namespace at all."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from offload_helpers import run_harness

pytestmark = [pytest.mark.loopdev, pytest.mark.usefixtures("deepspeed_ready")]

STEPS = 4
TiB = 1 << 40


def _run(tmp: Path, name: str, **kw: Any) -> dict[str, Any]:
    where = tmp / name
    where.mkdir()
    return run_harness("memstrata", where, steps=STEPS, **kw)


def _state_on_nvme(result: dict[str, Any]) -> int:
    return result["swap"]["nvme"]["byKind"]["optimizer"]["written"]


def test_resident_subgroups_move_no_bytes_and_train_the_same(loopdev, tmp_path: Path) -> None:
    streamed = _run(tmp_path, "streamed", nvme=[loopdev(384 << 20)], swap={"resident_state_bytes": 0})
    dram = streamed["swap"]["dram"]
    assert dram["residentSubgroups"] == 0 and dram["residentStateBytes"] == 0
    groups = len(dram["subGroupOrders"][0])
    assert groups >= 3, f"gpt-tiny must have several swapped sub-groups to keep some: {dram['subGroupOrders']}"
    # A budget of about half the state: whole sub-groups only, never more than the budget.
    budget = 3 * 4 * streamed["params"] // 2
    half = _run(tmp_path, "half", nvme=[loopdev(384 << 20)], swap={"resident_state_bytes": budget})
    kept = half["swap"]["dram"]
    assert 0 < kept["residentSubgroups"] < groups and 0 < kept["residentStateBytes"] <= budget
    # The kept sub-groups left NVMe: fewer optimizer bytes written, by at least the kept state each step (the
    # first write at init included).
    saved = _state_on_nvme(streamed) - _state_on_nvme(half)
    assert saved >= kept["residentStateBytes"] * STEPS, (saved, kept)
    # The peak state on the stratum shrank by at least what is resident (a streamed sub-group also owns an
    # fp32 gradient extent from ZeRO-3's initialisation, which a resident one never gets).
    peak = streamed["swap"]["nvme"]["bytesLivePeak"] - half["swap"]["nvme"]["bytesLivePeak"]
    assert peak >= kept["residentStateBytes"], (peak, kept["residentStateBytes"])
    # Same arithmetic, other memory: the losses agree to fp32 rounding.
    for i, (a, b) in enumerate(zip(streamed["losses"], half["losses"]), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {i}: streamed {a}, half resident {b}"


def test_a_budget_that_holds_everything_runs_with_no_namespace(tmp_path: Path) -> None:
    ours = _run(tmp_path, "all-dram",
                swap={"no_nvme": True, "resident_state_bytes": TiB, "resident_weight_bytes": TiB})
    nvme, dram = ours["swap"]["nvme"], ours["swap"]["dram"]
    assert nvme["namespaces"] == [] and nvme["bytesWritten"] == nvme["bytesRead"] == 0
    assert dram["residentStateBytes"] >= 3 * 4 * ours["params"] * 0.9
    assert dram["residentWeightBytes"] >= 2 * ours["params"] * 0.9
    assert dram["gradients"] is not None and dram["gradients"]["widenedBytes"] > 0, \
        "resident sub-groups' gradients are widened in the update, not kept as permanent fp32 copies"
    assert ours["losses"][-1] < ours["losses"][0]
