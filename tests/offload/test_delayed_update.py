"""The delayed update (memstrata.runtime.swap.delayed), asked for by name, on real DeepSpeed ZeRO-3.

gpt-tiny in 9 sub-groups, 16-bit weights in DRAM, optimizer state on a loop device (tests/offload/pipeline_worker.py),
held to a plain-PyTorch loop that applies each update one step late (tests/offload/delayed_reference.py): the same
loop with each update applied at once must be the in-place engine's run, so the reference is ZeRO-3's arithmetic.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_pipelined_update import REPO, SUB_GROUP, _run

pytestmark = [pytest.mark.loopdev, pytest.mark.usefixtures("deepspeed_ready")]

SWAP = {"prefetch_subgroups": 1, "cache_subgroups": 1}
REFERENCE = Path(__file__).with_name("delayed_reference.py")


def _reference(tmp: Path, steps: int, mode: str) -> dict[str, Any]:
    out = tmp / f"reference-{mode}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REFERENCE), str(out), str(steps), mode, str(SUB_GROUP)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_delayed_update_trains_as_each_update_applied_one_step_late(loopdev, tmp_path: Path) -> None:
    """Every loss and the final weights are the reference's delayed loop's, bit for bit, while the exact loop
    reproduces the in-place engine's: step t+1's gradient was taken at the weights from before step t's update.
    The first update's last Adam is held until the second forward has begun (the update ran beside it, and wrote
    weights the backward still read into shadows); the second update's first Adam until a second after the third
    forward began (that backward reached gradients the update had not read yet, and waited for them)."""
    dev = loopdev(512 << 20)
    steps = 5
    delayed = _run(dev, tmp_path, "delayed", {**SWAP, "delayed_update": True}, steps, "param=cpu",
                   "hold-last=1", "hold-seconds=3", "hold-first=2", "hold-after=1")
    in_place = _run(dev, tmp_path, "in-place", {**SWAP, "overlap_update": False}, steps, "param=cpu")
    late, exact = _reference(tmp_path, steps, "delayed"), _reference(tmp_path, steps, "exact")
    assert exact["losses"] == in_place["losses"] and exact["weights"] == in_place["weights"]
    assert delayed["losses"] == late["losses"], (delayed["losses"], late["losses"])
    assert delayed["weights"] == late["weights"]
    assert delayed["losses"][0] == in_place["losses"][0] and delayed["losses"][1] != in_place["losses"][1]
    assert delayed["held"] == [True, True], "a forward did not begin while the update before it ran"
    status = delayed["overlap"]
    # Every update joined by the time the weights were read: the last one by that read's gathers.
    assert status["on"] and status["mode"] == "delayed" and status["updates"] == steps, status
    assert status["lateSubgroups"] > 0 and status["shadowPeakBytes"] > 0, status
    assert status["backwardWaits"] > 0 and status["backwardWaitSeconds"] > 0.5, status


def test_refused_where_the_16_bit_weights_are_on_the_accelerator_and_the_reason_names_it() -> None:
    """The shadows would take the accelerator's memory, which the plan does not count: a partition on any device
    but the CPU (here the meta device, standing in for cuda) refuses the delayed update; CPU partitions do not."""
    import torch

    from memstrata.runtime.swap.delayed import delayed_refusal

    class Partitions:
        def __init__(self, device: str) -> None:
            self.fp16_partitioned_groups_flat = [torch.empty(4, device="cpu"), None, torch.empty(4, device=device)]

    assert delayed_refusal(Partitions("cpu")) is None  # type: ignore[arg-type]
    why = delayed_refusal(Partitions("meta"))  # type: ignore[arg-type]
    assert why is not None and why.startswith("16-bit weights on the accelerator")


def test_weights_on_nvme_refuse_it_and_the_update_runs_in_place_exactly(loopdev, tmp_path: Path) -> None:
    """Asked for where the forward reads weights from NVMe (the update's writes would share the rank's NVMe engine):
    refused in words the status carries, and the run is the in-place engine's, bit for bit."""
    dev = loopdev(512 << 20)
    asked = _run(dev, tmp_path, "asked", {**SWAP, "delayed_update": True}, 3)
    exact = _run(dev, tmp_path, "exact", {**SWAP, "overlap_update": False}, 3)
    assert not asked["overlap"]["on"] and asked["overlap"]["refused"].startswith("delayed update refused: weights on "
                                                                                 "NVMe"), asked["overlap"]
    assert asked["losses"] == exact["losses"] and asked["weights"] == exact["weights"]
