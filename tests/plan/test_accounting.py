"""Byte counts checked against numbers computed by hand (never by the code under test).

Llama-3-8B: vocab 128256, hidden 4096, 32 layers, MLP 14336, 32 heads / 8 KV heads, untied.
  embedding = LM head = 128256*4096 = 525,336,576
  per layer: q,o 4096*4096 = 16,777,216 each; k,v 4096*1024 = 4,194,304 each;
             MLP 3*4096*14336 = 176,160,768; 2 RMSNorms 8,192  -> 218,112,000
  total = 32*218,112,000 + 2*525,336,576 + 4,096 (final norm) = 8,030,261,248
"""
from __future__ import annotations

import pytest

from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.plan.accounting import JobShape, category_bytes
from memstrata.plan.buffers import pinned_buffers, streamed_subgroup_bytes


@pytest.mark.parametrize("preset,params", [
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("mistral-7b", 7_241_732_096),
    ("qwen2.5-14b", 14_770_033_664),   # Q/K/V biases: 7,168 per layer
    ("gpt-125m", 125_262_336),         # 50304 vocab, 2048 learned positions, tied head
])
def test_parameter_counts(preset: str, params: int) -> None:
    assert PRESETS[preset].parameters() == params


def test_llama3_8b_bf16_categories() -> None:
    job = JobShape(model=PRESETS["llama3-8b"], sequence_length=32768, micro_batch=1, precision="bf16", gpus=1,
                   engine="memstrata")
    b = category_bytes(job)
    assert b["optimizer"] == 64_242_089_984      # 2 moments x 4 B x 8,030,261,248
    assert b["master"] == 32_121_044_992         # 4 B
    assert b["weights"] == 16_060_522_496        # 2 B
    assert b["gradients"] == 16_060_522_496
    assert b["checkpoints"] == 8_589_934_592     # 32 layers x 32768 tokens x 4096 x 2 B


def test_fp32_still_has_zero3s_own_master_copy() -> None:
    job = JobShape(model=PRESETS["llama3-8b"], sequence_length=1024, micro_batch=1, precision="fp32", gpus=1)
    b = category_bytes(job)
    assert b["master"] == 32_121_044_992  # 4 B x 8,030,261,248: ZeRO-3's fp32 partitions, beside the weights
    assert b["weights"] == 32_121_044_992
    assert b["gradients"] == 32_121_044_992


def test_checkpoints_scale_with_ranks_and_state_does_not() -> None:
    shape = dict(model=PRESETS["mistral-7b"], sequence_length=4096, micro_batch=2, engine="memstrata")
    one = category_bytes(JobShape(**shape, gpus=1))
    eight = category_bytes(JobShape(**shape, gpus=8))
    assert eight["checkpoints"] == 8 * one["checkpoints"] == 8 * 2_147_483_648   # 32*4096*2*4096*2 B
    assert eight["optimizer"] == one["optimizer"]


def test_memstrata_pins_less_than_tuned_stock() -> None:
    """gpt-125m (layer 7,087,872 params; largest tensor 50304*768 = 38,633,472; 196 tensors), bf16.
    Stock, as dsconfig tunes it: 8 parameter buffers of the largest tensor, 8*38,633,472*2 = 618,135,552,
    plus 4 optimizer buffers of (sub-group 38,633,472 + one tensor of overshoot)*4 B = 1,236,271,104.
    memstrata: 2 layers (2*7,087,872*2 = 28,351,488 -> 28,352,512 page-rounded) + the largest tensor
    (77,266,944), plus the update's buffers (memstrata.plan.buffers.update_buffer_bytes): the embedding
    streams in slices of the unit rounded down to 2048 elements (7,086,080), the rest whole, the largest of which
    is a layer (7,087,872) that the 1,572,864-element position table pushed over a layer boundary and that ends
    with the next layer's 1,572,096 leading elements, 8,659,968 (memstrata.plan.accounting.group_tensors;
    tests/runtime/test_subgroup_layout.py checks the tensor list against the real model). The walk keeps one
    sub-group cached, held while the embedding's slices are updated. Reading one ahead:
    max(40 x 8,659,968, 44 x 7,086,080 + 12 x 8,659,968, 32 x 7,086,080 + 12 x 8,659,968) = 415,707,136; reading
    none: max(28 x 8,659,968, 32 x 7,086,080 + 12 x 8,659,968) = 330,674,176. With the embedding kept resident
    (its gradient widened a slice at a time) only the whole ones stream: 40 x 8,659,968 = 346,398,720."""
    shape = dict(model=PRESETS["gpt-125m"], sequence_length=1024, micro_batch=1, gpus=1)
    stock = pinned_buffers(JobShape(**shape, engine="deepspeed"), optimizer_on_nvme=True, params_on_nvme=True)
    ours = pinned_buffers(JobShape(**shape, engine="memstrata"), optimizer_on_nvme=True, params_on_nvme=True)
    assert stock == 618_135_552 + 1_236_271_104
    assert ours == 28_352_512 + 77_266_944 + 415_707_136
    serial = pinned_buffers(JobShape(**shape, engine="memstrata"), optimizer_on_nvme=True, params_on_nvme=True,
                            read_ahead=0)
    assert serial == 28_352_512 + 77_266_944 + 330_674_176
    layered = pinned_buffers(JobShape(**shape, engine="memstrata"), optimizer_on_nvme=True, params_on_nvme=True,
                             streamed_bytes=streamed_subgroup_bytes(JobShape(**shape, engine="memstrata"),
                                                                    463_601_664))
    assert layered == 28_352_512 + 77_266_944 + 346_398_720
    assert pinned_buffers(JobShape(**shape), optimizer_on_nvme=False, params_on_nvme=False) == 0
    eight = pinned_buffers(JobShape(**{**shape, "gpus": 8}, engine="memstrata"), optimizer_on_nvme=True,
                           params_on_nvme=True)
    # One set per rank; over 8 ranks each holds an eighth of every tensor, so every sub-group is smaller.
    per_rank = pinned_buffers(JobShape(**{**shape, "gpus": 8}, engine="memstrata"), optimizer_on_nvme=True,
                              params_on_nvme=True) // 8
    assert eight == 8 * per_rank and per_rank < ours


def test_the_vocabulary_does_not_set_the_update_buffers() -> None:
    """The update's locked buffers follow the layer, not the largest tensor: a 4x vocabulary leaves them as they
    were (the embedding streams a slice at a time), while stock's grow with it."""
    base = PRESETS["llama3.2-1b"]
    big = base.model_copy(update={"vocab": 4 * base.vocab})
    shape = dict(sequence_length=2048, micro_batch=8, gpus=1)
    ours = [streamed_subgroup_bytes(JobShape(model=m, **shape, engine="memstrata"), 0) for m in (base, big)]
    assert ours[0] == ours[1] > 0
    stock = [pinned_buffers(JobShape(model=m, **shape, engine="deepspeed"), optimizer_on_nvme=True,
                            params_on_nvme=False) for m in (base, big)]
    assert stock[1] > 3 * stock[0]


def test_architecture_rejects_heads_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match="divisible by heads"):
        ModelArchitecture(layers=2, hidden=100, intermediate=400, heads=3, kv_heads=1, vocab=10)
    with pytest.raises(ValueError, match="divisible by kvHeads"):
        ModelArchitecture(layers=2, hidden=96, intermediate=400, heads=6, kv_heads=4, vocab=10)
