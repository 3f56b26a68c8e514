"""The planner counts activations the way the runtime keeps them: `training.activationCheckpointing` on
keeps one hidden state per layer (the `checkpoints` category) and one layer's live activations on the
GPU; off keeps every layer's activations on the GPU and no checkpoints. Numbers computed by hand.

Llama-3-8B at s = 32768, b = 1, bf16 (see test_accounting for the parameter counts):
  one layer's activations A = 34·32768·4096 = 4,563,402,752 B (4.25 GiB)
  working set with checkpointing = 2·218,112,000·2·2 (two gathered layers and their gradients)
      + 525,336,576·2 (largest tensor) + A + 32768·128256·(2·2+8) (whole logits) + 2^30 (CUDA runtime)
    = 1,744,896,000 + 1,050,673,152 + 4,563,402,752 + 50,432,311,296 + 1,073,741,824 = 58,865,025,024
  without: + 31·A = 141,465,485,312 -> 200,330,510,336 B
  With the loss in chunks of 4096 tokens (the example's) the logits are 4096·128256·12 = 6,304,038,912 B.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from memstrata.api import load_job
from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.manifest import load_node
from memstrata.plan import JobShape, category_bytes, job_shape, plan_job, working_set


def _llama_32k(checkpointing: bool, precision: str = "bf16", sequence_length: int = 32768) -> JobShape:
    return JobShape(model=PRESETS["llama3-8b"], sequence_length=sequence_length, micro_batch=1, gpus=1,
                    precision=precision, activation_checkpointing=checkpointing, engine="memstrata")


def _example_spec(repo: Path, checkpointing: bool) -> FineTuneJobSpec:
    spec = load_job(repo / "examples/finetune.yaml").spec
    training = spec.training.model_copy(update={"activation_checkpointing": checkpointing})
    return spec.model_copy(update={"training": training})


# ZeRO-3's reduce bucket, one layer of bf16 gradients (218,112,000 elements), allocated whole on the GPU.
BUCKET = 436_224_000


def test_working_set_with_and_without_checkpointing_llama3_8b_32k() -> None:
    assert working_set(_llama_32k(True)) == 58_865_025_024 + BUCKET
    assert working_set(_llama_32k(False)) == 200_330_510_336 + BUCKET
    assert working_set(_llama_32k(False)) - working_set(_llama_32k(True)) == 31 * 4_563_402_752


def test_fp32_activations_count_double() -> None:
    # s = 1024 in fp32: 31 more layers of 34·1024·4096 elements at 4 B = 8,841,592,832 B.
    grown = working_set(_llama_32k(False, "fp32", 1024)) - working_set(_llama_32k(True, "fp32", 1024))
    assert grown == 8_841_592_832


def test_without_checkpointing_there_are_no_checkpoints_and_the_rest_is_unchanged() -> None:
    on, off = category_bytes(_llama_32k(True)), category_bytes(_llama_32k(False))
    assert on["checkpoints"] == 8_589_934_592      # 32 layers x 32768 tokens x 4096 x 2 B
    assert off["checkpoints"] == 0
    assert {k: v for k, v in off.items() if k != "checkpoints"} == {k: v for k, v in on.items()
                                                                    if k != "checkpoints"}


def test_the_spec_switch_reaches_the_shape(repo: Path) -> None:
    assert job_shape(_example_spec(repo, True)).activation_checkpointing is True
    assert job_shape(_example_spec(repo, False)).activation_checkpointing is False


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_plan_records_the_switch_for_the_runtime(repo: Path, checkpointing: bool) -> None:
    plan = plan_job(_example_spec(repo, checkpointing), load_node(repo / "examples/node-cxl.yaml"))
    assert plan.activation_checkpointing is checkpointing
    # It survives the trip through the runtime config (JSON) unchanged.
    assert type(plan).model_validate_json(plan.model_dump_json()).activation_checkpointing is checkpointing


def test_llama3_8b_32k_fits_on_80gib_only_with_checkpointing(repo: Path) -> None:
    node = load_node(repo / "examples/node-cxl.yaml")
    on = plan_job(_example_spec(repo, True), node)
    assert on.feasible, on.verdict()
    # The example chunks its loss by 4096 tokens: 4096·128256·12 B of logits instead of 32768·128256·12 B.
    assert on.category("working").on("hbm") == 58_865_025_024 - 50_432_311_296 + 6_304_038_912 + BUCKET
    assert on.category("checkpoints").bytes == 8_589_934_592

    off = plan_job(_example_spec(repo, False), node)
    assert not off.feasible
    assert [(s.stratum, s.category, s.missing_bytes) for s in off.shortfalls] == [("hbm", "working", 70_302_892_032 + BUCKET)]
    assert "each GPU needs 145.9 GiB for its working set and has 80.0 GiB" in off.verdict()
    assert off.category("checkpoints").bytes == 0


def test_stock_keeps_the_checkpoints_beside_the_compute() -> None:
    """Hugging Face's checkpointing keeps each layer's hidden state on the GPU; only memstrata's engine moves them
    to a host stratum, so a stock plan counts them in the working set and has no `checkpoints` category."""
    ours = _llama_32k(True)
    stock = ours.model_copy(update={"engine": "deepspeed"})
    assert category_bytes(stock)["checkpoints"] == 0
    assert working_set(stock) - working_set(ours) == 8_589_934_592


def test_a_chunked_loss_counts_one_chunk_of_logits() -> None:
    whole = _llama_32k(True)
    chunked = whole.model_copy(update={"loss_chunk_tokens": 2048})
    assert working_set(whole) - working_set(chunked) == (32768 - 2048) * 128256 * 12
    # A chunk longer than the sequence is the whole sequence.
    assert working_set(whole.model_copy(update={"loss_chunk_tokens": 65536})) == working_set(whole)


def test_checkpoints_go_whole_to_dram_when_cxl_cannot_hold_them_all(repo: Path) -> None:
    """One pool, one placement: CXL with room for part of them does not get that part."""
    node = load_node(repo / "examples/node-cxl.yaml")
    need = plan_job(_example_spec(repo, True), node).category("checkpoints").bytes
    small = node.model_copy(update={"cxl_nodes": [c.model_copy(update={"memory_bytes": need // 2})
                                                  for c in node.cxl_nodes]})
    plan = plan_job(_example_spec(repo, True), small)
    assert plan.feasible, plan.verdict()
    assert plan.category("checkpoints").on("dram") == need and plan.category("checkpoints").on("cxl") == 0
