"""The planner counts activations the way the runtime keeps them: `training.activationCheckpointing` on
keeps one hidden state per layer (the `checkpoints` category) and one layer's live activations on the
GPU; off keeps every layer's activations on the GPU and no checkpoints. Numbers computed by hand.

Llama-3-8B at s = 32768, b = 1, bf16 (see test_accounting for the parameter counts; h 4096, kv 1024, i 14336,
32 heads of 128):
  one layer saves 8h + 8 + 6h·2 + 2·1024·2 + 4·32 + 2·128·2 + 4·14336·2 = 201,352 B a token,
  so A = 201,352·32768 = 6,597,902,336 B (6.14 GiB); the final norm and the head keep (4 + 2·2)·4096 a token,
  H = 1,073,741,824 B
  working set with checkpointing = 2·218,112,000·2·2 (two gathered layers and their gradients)
      + 525,336,576·2 (largest tensor) + 2A + H (the layer recomputed, its gradients, the head's input)
      + 32768·128256·(2·2+8) (whole logits) + 2^30 (CUDA runtime)
    = 1,744,896,000 + 1,050,673,152 + 14,269,546,496 + 50,432,311,296 + 1,073,741,824 = 68,571,168,768
  without: + 31·A = 204,534,972,416 -> 273,106,141,184 B
  With the loss in chunks of 4096 tokens (the example's) the logits are 4096·128256·12 = 6,304,038,912 B.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from memstrata.api import load_job
from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.manifest import load_node
from memstrata.api.units import format_bytes
from memstrata.plan import JobShape, category_bytes, job_shape, plan_job, working_set
from memstrata.plan.accounting import activation_bytes, layer_activation_bytes


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
    assert working_set(_llama_32k(True)) == 68_571_168_768 + BUCKET
    assert working_set(_llama_32k(False)) == 273_106_141_184 + BUCKET
    assert working_set(_llama_32k(False)) - working_set(_llama_32k(True)) == 31 * 6_597_902_336


def test_fp32_activations_count_at_4_bytes() -> None:
    # s = 1024 in fp32: 31 more layers of 1024 tokens of 8h + 8 + 6h·4 + 2·1024·4 + 4·32 + 2·128·4 + 4·14336·4
    # = 369,800 B (the RMSNorms' fp32 copies do not double) = 11,738,931,200 B.
    grown = working_set(_llama_32k(False, "fp32", 1024)) - working_set(_llama_32k(True, "fp32", 1024))
    assert grown == 11_738_931_200


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
    assert on.category("working").on("hbm") == 68_571_168_768 - 50_432_311_296 + 6_304_038_912 + BUCKET
    assert on.category("checkpoints").bytes == 8_589_934_592

    off = plan_job(_example_spec(repo, False), node)
    assert not off.feasible
    missing = [(s.stratum, s.category, s.missing_bytes) for s in off.shortfalls]
    assert missing == [("hbm", "working", 143_078_522_880 + BUCKET)]
    assert "each GPU needs 213.7 GiB for its working set and has 80.0 GiB" in off.verdict()
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


def test_a_layer_counts_the_tensors_transformers_saves() -> None:
    """What one layer keeps for backward, a token, as torch's saved-tensor hooks measured it at b = 1 (the hand
    formula of each family: memstrata.plan.accounting.layer_activation_bytes)."""
    assert layer_activation_bytes(PRESETS["llama3.2-1b"], 4) == 201_352
    assert layer_activation_bytes(PRESETS["qwen2.5-14b"], 2) == 217_768
    assert layer_activation_bytes(PRESETS["gpt-125m"], 2) == 43_064


def test_smollm2_chat_at_1024_without_checkpointing_counts_what_the_run_holds() -> None:
    """The shipped chat example at sequenceLength 1024 (4 x 1024 tokens, bf16, lossChunkTokens 4096, on the CPU):
    30 layers x 4096 tokens x 24,876 B saved, one layer's more for backward, the head's input (4 + 4)·576 a
    token. Measured: 2.8 GiB of saved layer tensors, where 34·s·b·h counted 2.2 GiB and the run was OOM-killed."""
    smollm2 = ModelArchitecture(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, vocab=49152,
                                tied=True)
    job = JobShape(model=smollm2, sequence_length=1024, micro_batch=4, gpus=0, activation_checkpointing=False,
                   loss_chunk_tokens=4096, engine="memstrata")
    assert activation_bytes(job) == 4096 * (31 * 24_876 + 8 * 576) == 3_177_529_344
    checkpointed = job.model_copy(update={"activation_checkpointing": True})
    assert activation_bytes(checkpointed) == 4096 * (2 * 24_876 + 8 * 576)


def test_a_cpu_job_whose_working_set_outgrows_dram_says_by_how_much(repo: Path) -> None:
    """The refusal names the working set and what is over; nothing after it reads as less than nothing."""
    spec = _example_spec(repo, False)
    spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"gpus": 0}),
                                   "training": spec.training.model_copy(update={"sequence_length": 262144})})
    node = load_node(repo / "examples/node-cxl.yaml")
    plan = plan_job(spec, node.model_copy(update={"gpus": []}))
    assert not plan.feasible
    first = plan.shortfalls[0]
    assert (first.stratum, first.category) == ("dram", "working")
    assert "DRAM: the working set (live activations, logits, gathered layers) needs" in first.message
    assert f"(short by {format_bytes(first.missing_bytes)})" in first.message
    assert "set training.activationCheckpointing: true" in first.message
    assert not re.search(r"\s-\d", plan.verdict()), plan.verdict()
