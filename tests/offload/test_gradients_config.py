"""Which ds_configs get 16-bit gradient accumulation: only those where it changes no value."""
from __future__ import annotations

import json
from pathlib import Path

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
