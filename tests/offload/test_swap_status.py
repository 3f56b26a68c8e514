"""The swap layer's status: typed in Python, and the same camelCase JSON its readers (run report, benchmarks,
offload tests) have always read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is needed for the swap layer (run the tests with the venv)")

from memstrata.runtime.swap.layer import SwapLayer, SwapSettings  # noqa: E402

# The contract: benchmarks/offload/run.py, tests/offload/test_training.py and the run report read these names.
NVME_KEYS = ["namespaces", "bytesWritten", "bytesRead", "bytesLive", "bytesLivePeak", "extentsLive", "byKind",
             "ioTokenWaitSeconds", "ioTokenBypasses"]
DRAM_KEYS = ["lockedBytes", "lockedPeakInUse", "trimmedBytes", "pinnedBytes", "optimizerCacheBytes",
             "residentStateBytes", "residentSubgroups", "residentWeightBytes", "prefetchHits", "optimizerCacheHits",
             "slicedSubgroups", "slicesUpdated", "subGroupOrders", "gradients", "vmLockedBytes", "hugePageTensors"]


def test_status_json_has_the_keys_its_readers_use_and_counts_what_moved(tmp_path: Path) -> None:
    settings = SwapSettings(lock_memory=False, file_bytes=32 << 20, pool_chunk_bytes=1 << 20)
    layer = SwapLayer.open(settings, rank=0, local_rank=0, local_world=1, fallback_dir=tmp_path, needed_bytes=0)
    try:
        handle = layer.handle("optimizer")
        state = layer.pool.tensor(4096, torch.float32).fill_(1.5)
        handle.async_pwrite(state, "state")
        handle.wait()
        handle.async_pread(state, "state")
        handle.wait()
        wire = json.loads(json.dumps(layer.status().wire()))  # what a reader of the JSON file gets
    finally:
        layer.close()
    assert list(wire) == ["nvme", "dram", "updateOverlap", "activations"]
    assert wire["activations"] is None  # present, and null: no activation was offloaded
    # No ZeRO-3 optimizer was built on this layer: no update ran beside a forward, and the status says so.
    assert wire["updateOverlap"] == {"on": False, "mode": "beside the forward", "refused": "not installed",
                                     "updates": 0, "updateSeconds": 0.0, "forwardWaits": 0, "forwardWaitSeconds": 0.0,
                                     "joinWaitSeconds": 0.0, "backwardWaits": 0, "backwardWaitSeconds": 0.0,
                                     "lateSubgroups": 0, "shadowPeakBytes": 0}
    assert list(wire["nvme"]) == NVME_KEYS and list(wire["dram"]) == DRAM_KEYS
    nvme, dram = wire["nvme"], wire["dram"]
    assert nvme["byKind"] == {"optimizer": {"written": 16384, "read": 16384}}
    assert nvme["bytesWritten"] >= 16384 and nvme["extentsLive"] == 1 and nvme["bytesLivePeak"] >= 16384
    assert nvme["namespaces"] == [str(tmp_path / "memstrata-nvme-rank0.img")]
    assert dram["gradients"] is None and dram["subGroupOrders"] == []  # present, and null/empty when not in use
    assert dram["lockedPeakInUse"] >= 16384


def test_gradient_status_keeps_its_wire_names() -> None:
    from memstrata.runtime.swap.status import GradientStatus

    status = GradientStatus(dtype="bfloat16", nbytes=1024, widened_bytes=2048)
    assert status.wire() == {"dtype": "bfloat16", "bytes": 1024, "widenedBytes": 2048}
    assert GradientStatus.model_validate(status.wire()) == status  # a saved report reads back
