"""DeepSpeedCPUAdam's optimizer state as ZeRO-3's swapper names it: the facts memstrata relies on when it creates the
moments itself (the optimizer swapper's first update) or updates a sub-group a slice at a time
(memstrata.runtime.swap.sliced).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["ADAM_STATE", "name_state", "zero_started_adam"]

# DeepSpeedCPUAdam's state tensors, in the order its first step creates them (zeros, at step 0).
ADAM_STATE = ("exp_avg", "exp_avg_sq")


def zero_started_adam(optimizer: Any) -> bool:
    """Whether `optimizer` is DeepSpeedCPUAdam with fp32 moments: its first step creates them as zeros and its
    update is elementwise, so memstrata may create them itself (`_first_moments`, memstrata.runtime.swap.sliced)
    and update a sub-group a slice at a time."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return type(optimizer) is DeepSpeedCPUAdam and bool(getattr(optimizer, "fp32_optimizer_states", False))


def name_state(tensor: torch.Tensor, fp32: torch.Tensor, name: str) -> torch.Tensor:
    """`tensor`, named as stock names state `name` of sub-group `fp32` (`_get_state_tensors`): its swap name."""
    tensor.ds_id = f"{name}-{fp32.ds_id}"  # type: ignore[attr-defined]
    return tensor
