"""What stock DeepSpeed ZeRO-Infinity pins with the settings memstrata runs it with.

The planner counts a stock run's page-locked pools from here, and
memstrata.runtime.train.dsconfig configures DeepSpeed from the same numbers, so the
plan of a stock run is what the run really locks. Pure arithmetic over shapes.
"""
from __future__ import annotations

from memstrata.api.architecture import ModelArchitecture

# DeepSpeed's swap_tensor/utils.py: a tensor smaller than MIN_AIO_BYTES is never
# swapped by the optimizer swapper, it just stays in DRAM.
DS_MIN_AIO_BYTES = 1 << 20
# Elements per aio-aligned unit (AIO_ALIGNED_BYTES 1024 / 2-byte elements is 512; use the stricter fp32 count).
DS_ALIGN_ELEMENTS = 1024
# The parameter swapper holds one buffer per parameter tensor in use. A leaf
# module of ours owns at most 2 tensors (Linear weight + bias); the module
# being computed, those prefetched behind it and the tied embedding (gathered
# at both ends of the step) need a few more. With too few the swapper asserts
# "Not enough buffers"; DeepSpeed's 5 ran gpt-tiny, 8 is margin.
PARAM_BUFFER_COUNT = 8
# DeepSpeed's default: one sub-group being updated, one being read, two being written.
OPTIMIZER_BUFFER_COUNT = 4


def align_elements(n: int, unit: int = DS_ALIGN_ELEMENTS) -> int:
    return -(-n // unit) * unit


def tensor_sizes(arch: ModelArchitecture) -> list[int]:
    """Elements of every parameter tensor of the `transformers` model for `arch`, in `model.parameters()` order
    (shared tensors once): GPT-2 fuses Q/K/V into one `c_attn` matrix with one bias and has LayerNorms with
    biases; Llama-style blocks keep q/k/v/o apart (Q/K/V biases in Qwen2), then gate/up/down, then two RMSNorms."""
    h, i, kv, v = arch.hidden, arch.intermediate, arch.kv_dim, arch.vocab
    head = [] if arch.tied else [v * h]
    if arch.family == "gpt":
        layer = [h, h, h * 3 * h, 3 * h, h * h, h, h, h, h * i, i, i * h, h]
        return [v * h, arch.max_positions * h] + layer * arch.layers + [h, h] + head
    bias = arch.qkv_bias
    attention = [h * h, *([h] if bias else []), kv * h, *([kv] if bias else []), kv * h, *([kv] if bias else []),
                 h * h]
    layer = attention + [i * h, i * h, h * i, h, h]
    return [v * h] + layer * arch.layers + [h] + head


def param_tensors(arch: ModelArchitecture) -> int:
    """How many parameter tensors the `transformers` model for `arch` has (shared tensors once)."""
    return len(tensor_sizes(arch))


def largest_param(arch: ModelArchitecture) -> int:
    """Elements of the largest parameter tensor (embedding/head, MLP matrix or position table)."""
    positions = arch.max_positions * arch.hidden if arch.family == "gpt" else 0
    return max(arch.largest_tensor(), positions)


def sub_group_size(arch: ModelArchitecture) -> int:
    return max(arch.layer_params(), largest_param(arch), DS_MIN_AIO_BYTES // 4)


def param_buffer_count(arch: ModelArchitecture) -> int:
    return min(param_tensors(arch), PARAM_BUFFER_COUNT)


def pinned_pool_bytes(arch: ModelArchitecture, weight_bytes: int, params_on_nvme: bool,
                      optimizer_on_nvme: bool) -> int:
    """Host memory DeepSpeed locks for its swap pools with this config (one rank).

    Both pools come from DeepSpeed's aio op (posix_memalign + mlock, exact size,
    no power-of-two rounding): the parameter pool is buffer_count x buffer_size
    elements of the training precision; the optimizer pool is
    OPTIMIZER_BUFFER_COUNT buffers of the largest sub-group in fp32, and a
    sub-group closes once it reaches sub_group_size, so it can overshoot by up
    to one tensor. Meant for the planner (memstrata.plan.accounting), so the plan
    of a stock run counts what the run really pins.
    """
    total = 0
    if params_on_nvme:
        total += param_buffer_count(arch) * align_elements(largest_param(arch)) * weight_bytes
    if optimizer_on_nvme:
        total += OPTIMIZER_BUFFER_COUNT * align_elements(sub_group_size(arch) + largest_param(arch)) * 4
    return total
