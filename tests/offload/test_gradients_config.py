"""Which ds_configs get 16-bit gradient accumulation: only those where it changes no value."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memstrata.runtime.swap.gradients import accumulation_config

BF16 = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


def test_one_micro_step_per_step_gets_the_training_dtype() -> None:
    out = accumulation_config(BF16)
    assert out["data_types"] == {"grad_accum_dtype": "bf16"}
    assert "data_types" not in BF16  # the caller's dict is not modified
    fp16 = {**BF16, "bf16": {"enabled": False}, "fp16": {"enabled": True}, "gradient_accumulation_steps": 1}
    assert accumulation_config(fp16)["data_types"]["grad_accum_dtype"] == "fp16"


def test_accumulation_fp32_training_and_user_choice_are_left_alone() -> None:
    accumulating = {**BF16, "gradient_accumulation_steps": 4}
    assert accumulation_config(accumulating) is accumulating  # summing 4 micro-steps in bf16 would lose bits
    by_batch = {**BF16, "train_batch_size": 8}  # 8 / (2 x 1 rank) = 4 micro-steps
    assert accumulation_config(by_batch) is by_batch
    fp32 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    assert accumulation_config(fp32) is fp32
    chosen = {**BF16, "data_types": {"grad_accum_dtype": "fp32"}}
    assert accumulation_config(chosen) is chosen


def test_a_config_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BF16))
    assert accumulation_config(path)["data_types"]["grad_accum_dtype"] == "bf16"
    missing = tmp_path / "missing.json"
    assert accumulation_config(missing) == missing  # DeepSpeed names the unreadable file itself


def test_the_boundary_norm_is_stocks_without_widening_the_whole_partition() -> None:
    """gpt-125m's embedding gradient is 38.6M elements: stock widens it whole to fp64 for its norm (309 MB, the
    backward's host peak); memstrata's norm widens NORM_CHUNK_ELEMENTS at a time and agrees with stock's."""
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from torch.profiler import ProfilerActivity, profile

    from memstrata.runtime.swap.gradients import NORM_CHUNK_ELEMENTS, partition_norm

    grad = (torch.randn(5 * NORM_CHUNK_ELEMENTS + 123, generator=torch.Generator().manual_seed(3)) * 1e-3
            ).to(torch.bfloat16)

    def biggest_block(fn: Any) -> tuple[Any, int]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            out = fn()
        return out, max(e.cpu_memory_usage for e in p.events())

    stock, stock_block = biggest_block(lambda: DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2(None, grad))
    ours, our_block = biggest_block(lambda: partition_norm(grad))
    assert ours.dtype == stock.dtype == torch.float64
    assert abs(ours.item() - stock.item()) <= 1e-12 * stock.item()
    assert stock_block >= grad.numel() * 8  # the whole partition, widened
    assert our_block <= NORM_CHUNK_ELEMENTS * 8, our_block
    assert partition_norm(torch.zeros(0, dtype=torch.bfloat16)).item() == 0.0
