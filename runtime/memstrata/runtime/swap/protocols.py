"""The DeepSpeed objects memstrata's swap layer handles, typed by exactly the attributes it uses.

DeepSpeed ships no type information; these Protocols are what a type checker (and a reader) knows of
its objects. Each DeepSpeed name below is also an entry of memstrata.runtime.swap.seam, which checks it
against the installed DeepSpeed; a member added here without an entry there fails tests/offload/test_seam.py.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, overload

if TYPE_CHECKING:
    import torch

    from memstrata.runtime.swap.layer import SwapLayer

__all__ = ["DsConfig", "Engine", "PartitionedTensor", "SwapInfo", "ZeroConfig", "ZeroOptimizer", "ZeroParam"]


class PartitionedTensor(Protocol):
    """`param.ds_tensor`: this rank's partition of a ZeRO-3 parameter."""

    data: torch.Tensor
    status: enum.Enum  # a PartitionedParamStatus


class ZeroParam(Protocol):
    """A parameter zero.Init has partitioned."""

    ds_id: int
    ds_tensor: PartitionedTensor
    nvme_swapper: Any  # the parameter swapper, on a parameter whose partition goes to NVMe
    all_gather: Callable[..., Any]  # wrapped on the instance (memstrata.runtime.swap.overlap)
    all_gather_coalesced: Callable[..., Any]
    requires_grad: bool  # frozen ones (LoRA's base weights) get no gradient (memstrata.runtime.swap.delayed)


class SwapInfo(Protocol):
    """OptimizerStateSwapInfo: the optimizer swapper's record of one fp32 sub-group and its state tensors."""

    param_id: str
    swap_buffers: list[torch.Tensor]
    has_state_tensors: bool

    def num_tensors(self) -> int: ...
    def numel(self) -> int: ...
    def has_gradients(self) -> bool: ...
    def get_compute_tensors(self) -> list[torch.Tensor]: ...
    def release_memory(self) -> None: ...
    def release_unswapped_gradients(self) -> None: ...
    def set_swap_buffers(self, buffers: list[torch.Tensor], aligned_numel: int) -> None: ...


class ZeroOptimizer(Protocol):
    """DeepSpeedZeroOptimizer_Stage3, the instance memstrata's hooks are installed on."""

    fp16_groups: list[list[ZeroParam]]
    fp32_partitioned_groups_flat: list[torch.Tensor]
    grad_position: dict[int, list[int]]  # param id -> [sub-group, offset, numel] in its fp32 gradient
    grad_partitions_flat_buffer: torch.Tensor
    _DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition: dict[int, torch.Tensor]
    norm_for_param_grads: dict[int, torch.Tensor]
    dp_process_group: object
    optimizer_swapper: object | None
    # Replaced or wrapped on the instance, hence attributes rather than methods.
    step: Callable[..., object]
    has_overflow: Callable[..., bool]
    _offload_grad_partition_at_boundary: Callable[[ZeroParam, torch.Tensor, dict[int, list[torch.Tensor]],
                                                   dict[int, list[int]]], None]
    _prepare_sub_group: Callable[..., object]
    _release_sub_group: Callable[..., object]
    _get_fp32_grad_state_partition: Callable[..., tuple[torch.Tensor, int]]
    set_fp32_grad_for_param: Callable[..., None]
    set_local_grad_for_param: Callable[..., None]
    fp16_partitioned_groups_flat_numel: list[int]
    # The sliced update (memstrata.runtime.swap.sliced): the 16-bit partitions it casts slices into, the loop's
    # unscale and Adam it runs per slice, the CPU optimizer whose state it binds to each slice.
    fp16_partitioned_groups_flat: list[torch.Tensor | None]
    fp16_partitioned_groups: list[list[PartitionedTensor]]
    sub_group_size: int
    optimizer: Any
    unscale_and_clip_grads: Callable[..., object]
    _optimizer_step: Callable[..., object]
    _unflatten_partitioned_parameters: Callable[[int], None]
    torch_autocast_gradscaler: Any
    # The overlapped update (memstrata.runtime.swap.overlap): what refuses it, the forward's parameter order, the
    # calls it signals from and the ones it joins before.
    module: Any
    persistent_parameters: list[Any]
    zero_hpz_partition_size: int
    use_muon: bool
    _reassign_or_swap_out_partitioned_parameters: Callable[[int], object]
    state_dict: Callable[..., Any]
    load_state_dict: Callable[..., Any]
    memstrata_overlap: Any  # memstrata's own: the OverlappedUpdate installed on it
    # The delayed update (memstrata.runtime.swap.delayed): the backward's gradient writes it waits in and marks,
    # and the norms' reset it moves off the update thread.
    partition_grads: Callable[[list[Any], list[torch.Tensor]], Any]
    reset_cpu_buffers: Callable[[], None]
    is_gradient_accumulation_boundary: Callable[[], bool]

    # A parameter's ds_id: an int for a model parameter, "first_last" ids for an fp32 sub-group tensor.
    @overload
    def get_param_id(self, param: ZeroParam) -> int: ...
    @overload
    def get_param_id(self, param: torch.Tensor) -> str: ...
    def _swappable_optimizer_subgroup(self, sub_group_id: int) -> bool: ...
    def _model_parallel_all_reduce(self, tensor: torch.Tensor, op: object) -> None: ...


class Engine(Protocol):
    """DeepSpeedEngine, as initialize finishes it: the ZeRO-3 optimizer and the precision."""

    optimizer: object
    memstrata: SwapLayer  # memstrata's own, set by initialize: the engine's swap layer
    forward: Callable[..., Any]  # wrapped on the instance (memstrata.runtime.swap.overlap)
    backward: Callable[..., Any]  # wrapped on the instance (memstrata.runtime.swap.delayed)
    module: Any

    def fp16_enabled(self) -> bool: ...


class TrainingEngine(Protocol):
    """DeepSpeedEngine as a training loop drives it: forward, backward, step, on its device."""

    device: Any
    module: Any

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def backward(self, loss: Any) -> Any: ...

    def step(self) -> None: ...

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def empty_partition_cache(self) -> None: ...

    # The scheduler train.schedule.build_scheduler made; DeepSpeed steps it and checkpoints its state_dict.
    lr_scheduler: Any

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self) -> Any: ...  # a float or 0-d tensor, None before the first step


class ZeroConfig(Protocol):
    offload_param: object


class DsConfig(Protocol):
    """DeepSpeedConfig, as the parameter swapper's _configure_aio is handed it."""

    zero_config: ZeroConfig
    aio_config: dict[str, object]
