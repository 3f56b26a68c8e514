"""What ZeRO-3 pins, on memstrata's engine: exact buffers from the swap layer's pools, never torch's allocator.

With `pin_memory` on, DeepSpeed pins the 16-bit weights it keeps in host memory and the flat gradient buffer
through its accelerator, i.e. torch's caching host allocator on a GPU, which rounds every request up to a power of
two and never gives a block back. These tests run a real memstrata run of the tiny job (real DeepSpeed) with that
pinning function replaced by one that rounds and counts as torch's does, and check that not one pin reaches it,
that DeepSpeed's pins were all served by the pools, and that what they hold is what the plan puts in DRAM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memstrata.runtime.swap.layer import SwapLayer, SwapSettings

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "pin_worker.py"
ALIGN = 4096


def _tiny_job(tmp_path: Path, budget: str) -> Path:
    spec = yaml.safe_load((REPO / "examples" / "finetune-tiny.yaml").read_text())
    spec["spec"]["training"]["steps"] = 2
    spec["spec"]["memory"]["dramBudget"] = budget
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.usefixtures("deepspeed_ready")
@pytest.mark.parametrize("budget", ["8Mi", "64Mi"])
def test_every_pin_deepspeed_asks_for_is_an_exact_buffer_within_the_plan(tmp_path: Path, budget: str) -> None:
    """8Mi: weights and optimizer state partly on NVMe; 64Mi: everything in DRAM, where ZeRO-3 copies the weights
    zero.Init pinned one by one into one pinned flat buffer and drops the first copies without unpinning them."""
    out, nvme = tmp_path / "out.json", tmp_path / "nvme"
    nvme.mkdir()
    proc = subprocess.run([sys.executable, str(WORKER), str(_tiny_job(tmp_path, budget)), str(nvme), str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["torch_pins"]["pins"] == 0, "a pin reached torch's power-of-two allocator"
    dram = result["report"]["memstrata"]["dram"]
    weights, gradients = result["plan_dram"]["weights"], result["plan_dram"]["gradients"]
    assert dram["gradients"]["bytes"] == gradients  # the flat gradient buffer, 16-bit, exactly as planned
    # Pinned now: that buffer and the weights kept in DRAM, each rounded to 4 KiB, not to a power of two.
    tensors = 2 * 4 + 4  # gpt-tiny: 2 blocks of 4 matrices, embeddings and head; norms and biases are smaller
    assert gradients + dram["residentWeightBytes"] <= dram["pinnedBytes"]
    assert dram["pinnedBytes"] <= gradients + weights + 64 * ALIGN + tensors * ALIGN


@pytest.mark.parametrize("on_cxl,nodes", [(True, (1,)), (False, (0,))])
def test_pinned_weights_are_placed_where_the_plan_put_the_weights(tmp_path: Path, on_cxl: bool,
                                                                   nodes: tuple[int, ...]) -> None:
    """Pinned by torch, every weight lands in DRAM; from the layer's pool, on the CXL nodes when the plan put the
    weights there, bound to DRAM when it did not. The gradients, operands of the CPU optimizer, stay on DRAM."""
    settings = SwapSettings(no_nvme=True, lock_memory=False, dram_nodes=[0], cxl_nodes=[1], weights_on_cxl=on_cxl)
    layer = SwapLayer.open(settings, rank=0, local_rank=0, local_world=1, fallback_dir=tmp_path, needed_bytes=0)
    try:
        placement = layer.pinned_weights.placement
        assert placement is not None and placement.nodes == nodes
        operands = layer.pinned_operands.placement
        assert operands is not None and operands.nodes == (0,)
    finally:
        layer.close()
