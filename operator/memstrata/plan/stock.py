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


def param_tensors(arch: ModelArchitecture) -> int:
    """How many parameter tensors the `transformers` model for `arch` has (shared tensors once)."""
    return len(arch.tensor_sizes())


def largest_param(arch: ModelArchitecture) -> int:
    """Elements of the largest parameter tensor (embedding/head, MLP matrix or position table)."""
    return arch.spec.largest_param(arch)


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
