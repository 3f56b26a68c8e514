"""A sub-group larger than a slice (the embedding) updated a slice at a time (memstrata.runtime.swap.sliced).

Real DeepSpeed ZeRO-3 on gpt-tiny with sub-groups of 2^14 elements on a loop device, one process per run
(tests/offload/pipeline_worker.py): each of its tensors above 2^14 elements (the embeddings, the MLP and
attention matrices) is a sub-group of its own, in 3 or 4 slices. Sliced and whole, the runs must train bit for bit alike, with the 16-bit weights on
NVMe and in DRAM, over steps that reverse the order and serve the DRAM cache; the update's locked buffers must be
bounded by the slice, not by the largest tensor.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from test_pipelined_update import _run

pytestmark = [pytest.mark.loopdev, pytest.mark.usefixtures("deepspeed_ready")]

SLICE = 1 << 14
STATE = 12  # fp32 master and two Adam moments per element


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_sliced_embedding_trains_bit_for_bit_as_whole(loopdev, tmp_path: Path, param: str) -> None:
    dev = loopdev(768 << 20)
    swap = {"prefetch_subgroups": 1, "cache_subgroups": 1, "checksums": True}
    steps = 3
    args = (f"sub-group={SLICE}", f"param={param}", f"init-chunk={SLICE}")
    whole = _run(dev, tmp_path, f"whole-{param}", {**swap, "slice_subgroups": False}, steps, *args)
    sliced = _run(dev, tmp_path, f"sliced-{param}", swap, steps, *args)
    numels = sliced["numels"]
    big = [i for i, n in enumerate(numels) if n > SLICE]
    assert whole["sliced"] == [] and sliced["sliced"] == big and len(big) >= 4, (sliced["sliced"], numels)
    assert sliced["slices"] == steps * sum(-(-numels[i] // SLICE) for i in big)
    # The job's status says so too.
    assert sliced["status"]["slicedSubgroups"] == len(big) and sliced["status"]["slicesUpdated"] == sliced["slices"]
    assert sliced["losses"] == whole["losses"]
    assert sliced["weights"] == whole["weights"]
    # Whole, the update held a big tensor's state and more; sliced, at most three slices' state and two
    # gradients, or the streamed sub-groups' (each under 2 x 2^14 elements) three states and one gradient.
    largest = max(numels[i] for i in big)
    assert whole["pool_peak"] >= largest * STATE
    assert sliced["pool_peak"] <= 2 * SLICE * (3 * STATE + 4), (sliced["pool_peak"], whole["pool_peak"])
    assert sliced["pool_locked"][-1] == sliced["pool_locked"][1], "the pool grew after the second step"
    # Construction wrote every master a chunk at a time: one tensor's fp32 chunk and (from NVMe) its 16-bit chunk,
    # or a sub-group of several small tensors whole (under 2 x 2^14 elements), never two buffers of the largest
    # sub-group as stock's initialisation stages them (8 B x the largest tensor).
    assert sliced["init_peak"] <= 2 * SLICE * (4 + 2) < 8 * largest, sliced["init_peak"]
    if param == "nvme":  # the big tensors' 16-bit partitions went to NVMe a slice at a time, each step
        assert sliced["param_bytes"][0] >= whole["param_bytes"][0] > 0
        # Without read-ahead each slice is read when it is needed: the same training, fewer buffers at once.
        serial = _run(dev, tmp_path, "serial", {**swap, "prefetch_subgroups": 0}, steps, *args)
        assert serial["losses"] == whole["losses"] and serial["weights"] == whole["weights"]
        assert serial["slices"] == sliced["slices"] and serial["pool_peak"] < sliced["pool_peak"]


def test_a_resident_big_tensor_widens_a_slice_of_gradient_at_a_time(loopdev, tmp_path: Path) -> None:
    """With every sub-group kept in DRAM the big tensors are updated in place a slice at a time: the same training
    as whole, and the optimizer pool never holds more than a slice's gradient and a small sub-group's."""
    dev = loopdev(256 << 20)
    swap = {"prefetch_subgroups": 1, "cache_subgroups": 1, "resident_state_bytes": 1 << 40}
    args = (f"sub-group={SLICE}", "param=cpu", f"init-chunk={SLICE}")
    whole = _run(dev, tmp_path, "whole", {**swap, "slice_subgroups": False}, 3, *args)
    sliced = _run(dev, tmp_path, "sliced", swap, 3, *args)
    numels = sliced["numels"]
    big = [i for i, n in enumerate(numels) if n > SLICE]
    assert sliced["sliced"] == big and sliced["swappable"] == 0 == whole["swappable"]
    assert sliced["losses"] == whole["losses"] and sliced["weights"] == whole["weights"]
    assert whole["pool_peak"] >= 4 * max(numels)  # the largest tensor's fp32 gradient, widened whole
    assert sliced["pool_peak"] <= 4 * 2 * SLICE, sliced["pool_peak"]
