"""The optimizer update beside the next forward (memstrata.runtime.swap.overlap), on real DeepSpeed ZeRO-3.

gpt-tiny in 13 sub-groups, 16-bit weights in DRAM, optimizer state on a loop device, one process per run
(tests/offload/pipeline_worker.py). The overlap must change no loss and no weight, even with the learning rate
changing every step; the next forward must really begin while the update still runs; an update's failure must
reach the caller.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from test_pipelined_update import _run

pytestmark = [pytest.mark.loopdev, pytest.mark.usefixtures("deepspeed_ready")]

SWAP = {"prefetch_subgroups": 1, "cache_subgroups": 1}


def test_the_update_beside_the_forward_trains_bit_for_bit_as_in_place(loopdev, tmp_path: Path) -> None:
    """The first update's last Adam is held until the second forward has begun: that forward starts while a
    sub-group is not yet updated, waits at that sub-group's gather, and every loss and weight (under a warm-up
    learning rate the scheduler changes right after each step() returns) is the in-place update's; so is what a
    checkpoint right after step() reads."""
    dev = loopdev(512 << 20)
    steps = 4
    beside = _run(dev, tmp_path, "beside", {**SWAP, "overlap_update": True}, steps, "param=cpu", "warmup=5",
                  "hold-last=1,2", "hold-seconds=3", "ckpt-after=2")
    in_place = _run(dev, tmp_path, "in-place", {**SWAP, "overlap_update": False}, steps, "param=cpu", "warmup=5",
                    "ckpt-after=2")
    assert beside["held"][0] is True, "the next forward did not begin while the update ran"
    # A checkpoint taken right after step() (memstrata's own, through ZeRO-3's swap calls) waited for the held
    # update instead of reading a sub-group half-updated: the second hold ran out, the state is the in-place one.
    assert beside["held"][1] is False and beside["ckpt"]["seconds"] > 2.5, beside["ckpt"]
    assert beside["ckpt"]["digest"] == in_place["ckpt"]["digest"]
    assert beside["losses"] == in_place["losses"]
    assert beside["weights"] == in_place["weights"]
    assert len(set(beside["lrs"])) == steps, beside["lrs"]
    status = beside["overlap"]
    assert status["on"] and status["updates"] == steps - 1, status  # the last one is joined at close
    assert status["forwardWaits"] > 0, status
    # The forward's order every step (the cache keeps the first sub-groups), never reversed.
    assert all(order == beside["orders"][0] for order in beside["orders"]), beside["orders"]
    assert beside["orders"][0] == sorted(beside["orders"][0])
    assert not in_place["overlap"]["on"] and in_place["overlap"]["refused"] == "overlap_update is off"


def test_a_failed_update_beside_the_forward_raises_in_that_forward(loopdev, tmp_path: Path) -> None:
    """Adam failing on the second sub-group of step 2's update once step 3's forward has begun: step() has
    returned, so the error is raised by that forward, named as the update's, and nothing read ahead outlives it."""
    r = _run(loopdev(512 << 20), tmp_path, "fail", {**SWAP, "overlap_update": True}, 3, "param=cpu", "fail-at=2",
             "fail-late=1")
    f = r["failure"]
    assert r["held"] == [True], "step 3's forward did not begin while step 2's update ran"
    assert f and f["step"] == 3 and f["at"] == "forward", f
    assert any("memstrata.runtime.swap.overlap" in note for note in f["notes"]), f
    assert f["reads_in_flight"] == 0 and f["in_use"] == f["cache"], f
