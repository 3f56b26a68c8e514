"""Gradients kept in DRAM in the training dtype until the update converts them (MLP-Offload).

Stock ZeRO-3 with `offload_optimizer.device: nvme` (DeepSpeed 0.19.8,
stage3.py) keeps every gradient partition in `grad_partitions_flat_buffer`,
a DRAM buffer of the whole partition in the accumulation dtype (the model's
dtype unless `data_types.grad_accum_dtype` says otherwise), *and* at each
accumulation boundary converts each partition to an fp32 copy and writes it to
NVMe (`_offload_grad_partition_at_boundary` -> `swap_out_gradients`), only to
read it back in the update. With this hook:

- the flat buffer stays as it is; `accumulation_config` only pins its dtype
  to the training dtype when one micro-step makes a step (DeepSpeed 0.19.8's
  own default, made explicit so a later default cannot silently widen it);
- at the boundary only the gradient norm is recorded (as stock does); nothing
  is copied or written, so no gradient staging buffers are pinned;
- when the update swaps a sub-group in, the optimizer swapper widens that
  sub-group's gradients from the flat buffer into one fp32 buffer of exactly
  the sub-group's size (`fill_fp32_gradients`), released with its state.

Per step this removes 2 x 4 bytes per parameter of NVMe traffic and the
gradient swapper's two pinned buffers of the largest sub-group.

Sub-groups kept in DRAM for good (memstrata.runtime.swap.resident) are treated
alike: stock gives each one a permanent fp32 gradient buffer (4 bytes per
parameter) and copies into it at the boundary; here that buffer is released
after construction, and the update widens the sub-group's gradients into an
exact buffer from the locked pool when it reaches the sub-group
(`_prepare_sub_group`) and frees it after (`_release_sub_group`).
"""
from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memstrata.runtime.swap.protocols import ZeroOptimizer, ZeroParam
from memstrata.runtime.swap.status import GradientStatus

if TYPE_CHECKING:
    from memstrata.runtime.swap.layer import SwapLayer

__all__ = ["accumulation_config", "install_dram_gradients", "DramGradients"]

_SIXTEEN_BIT = {"bf16": "bf16", "fp16": "fp16"}


def _steps_per_update(cfg: dict[str, Any]) -> int | None:
    """Micro-steps per optimizer step, or None when it depends on the world size (resolved by DeepSpeed)."""
    if "gradient_accumulation_steps" in cfg:
        return int(cfg["gradient_accumulation_steps"])
    if "train_batch_size" in cfg and "train_micro_batch_size_per_gpu" in cfg:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return int(cfg["train_batch_size"]) // max(1, int(cfg["train_micro_batch_size_per_gpu"]) * world)
    return 1 if "train_batch_size" not in cfg else None


def config_dict(config: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """A ds_config as a dict: itself, or a JSON file read; None where it is neither (DeepSpeed reports an unreadable
    config in its own words)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            loaded = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            return None
        return loaded if isinstance(loaded, dict) else None
    return config if isinstance(config, dict) else None


def accumulation_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any] | str | os.PathLike[str]:
    """The ds_config with `data_types.grad_accum_dtype` set to the training dtype where that changes no value.

    Only when one micro-step makes a step (nothing is accumulated, so a 16-bit
    gradient widened later equals one widened now) and the user set no
    accumulation dtype; DeepSpeed 0.19.8 defaults to the same, this pins it.
    Pure: returns a new dict, or the argument unchanged."""
    cfg = config_dict(config)
    if cfg is None:
        return config
    if (cfg.get("data_types") or {}).get("grad_accum_dtype") is not None or _steps_per_update(cfg) != 1:
        return config
    dtype = next((name for name in _SIXTEEN_BIT if (cfg.get(name) or {}).get("enabled")), None)
    if dtype is None:
        return config
    out = copy.deepcopy(cfg)
    out.setdefault("data_types", {})["grad_accum_dtype"] = _SIXTEEN_BIT[dtype]
    return out


class DramGradients:
    """Where a ZeRO-3 sub-group's gradients are: per parameter, a view of the optimizer's flat buffer."""

    def __init__(self, optimizer: ZeroOptimizer) -> None:
        self.opt = optimizer
        # fp32 flat sub-group parameter (what the swapper is handed) -> sub-group index
        self._group_of = {id(p): i for i, p in enumerate(optimizer.fp32_partitioned_groups_flat)}
        self.bytes_widened = 0

    def status(self) -> GradientStatus:
        flat = self.opt.grad_partitions_flat_buffer
        return GradientStatus(dtype=str(flat.dtype).removeprefix("torch."), nbytes=flat.numel() * flat.element_size(),
                              widened_bytes=self.bytes_widened)

    def holds(self, fp32_param: torch.Tensor) -> bool:
        i = self._group_of.get(id(fp32_param))
        return i is not None and bool(self.opt._swappable_optimizer_subgroup(i))

    def _pieces(self, fp32_param: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(offset in the sub-group, numel, the parameter's view of the flat buffer), per parameter.
        Looked up on every call: `offload_states`/`reload_states` rebuild the views over new storage."""
        opt = self.opt
        views = opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        for param in opt.fp16_groups[self._group_of[id(fp32_param)]]:
            _, offset, numel = opt.grad_position[opt.get_param_id(param)]
            yield offset, numel, views[param.ds_id].narrow(0, 0, numel)

    def fill_fp32_gradients(self, fp32_param: torch.Tensor, dest: torch.Tensor) -> None:
        """Widen sub-group `fp32_param`'s gradients into `dest` (fp32, at least the sub-group's size)."""
        self.fill_fp32_range(fp32_param, dest, 0, dest.numel())

    def fill_fp32_range(self, fp32_param: torch.Tensor, dest: torch.Tensor, start: int, length: int) -> None:
        """Widen elements [start, start + length) of sub-group `fp32_param`'s gradients into `dest` from its 0
        (memstrata.runtime.swap.sliced: one slice)."""
        end = start + length
        for offset, numel, view in self._pieces(fp32_param):
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                dest.narrow(0, lo - start, hi - lo).copy_(view.narrow(0, lo - offset, hi - lo))
                self.bytes_widened += (hi - lo) * dest.element_size()

    def store_fp32_gradients(self, fp32_param: torch.Tensor, src: torch.Tensor) -> None:
        """Write an fp32 gradient that was changed in place (DeepSpeed's `safe_set_full_grad`, Muon) back to
        the flat buffer, where the next swap-in widens it from; in a 16-bit buffer it is rounded to that dtype."""
        for offset, numel, view in self._pieces(fp32_param):
            view.copy_(src.narrow(0, offset, numel))


# Elements of a gradient partition widened at once for its norm. Stock (`_constant_buffered_norm2`) widens up to
# 250M at once to DeepSpeed's norm dtype (fp64 where the device has it): 309 MB for gpt-125m's embedding, which set
# the backward's host peak; this bounds the copy to 8 MiB.
NORM_CHUNK_ELEMENTS = 1 << 20


def partition_norm(grad: torch.Tensor) -> torch.Tensor:
    """The L2 norm of one gradient partition as stock records it at the boundary (its squares summed in DeepSpeed's
    norm dtype), widened NORM_CHUNK_ELEMENTS at a time. The chunks' partial sums are added in a different order
    than one whole reduction: in fp64 the two agree to about 1e-15 relative, and every memstrata path uses this."""
    from deepspeed.runtime.zero.utils import get_norm_dtype

    dtype = get_norm_dtype()
    total = torch.zeros((), dtype=dtype, device=grad.device)  # 0 + the first square is that square, exactly
    for part in grad.reshape(-1).split(NORM_CHUNK_ELEMENTS):
        total += torch.linalg.vector_norm(part, dtype=dtype) ** 2.0
    return total ** 0.5


def install_dram_gradients(optimizer: ZeroOptimizer, layer: SwapLayer) -> DramGradients:
    """Stop ZeRO-3 from copying and swapping gradients of NVMe sub-groups and of resident ones; the update
    widens them instead. Installed before memstrata.runtime.swap.suborder, whose wrappers then call these with
    real sub-group ids.

    The optimizer's names used here are checked by memstrata.runtime.swap.seam before initialize."""
    from memstrata.runtime.swap.resident import resident_ids

    grads = DramGradients(optimizer)
    resident = resident_ids(optimizer)
    original = optimizer._offload_grad_partition_at_boundary

    def at_boundary(param: ZeroParam, grad_buffer: torch.Tensor, offload_fp32_gradients: dict[int, list[torch.Tensor]],
                    offload_fp32_offsets: dict[int, list[int]]) -> None:
        pid = optimizer.get_param_id(param)
        group = optimizer.grad_position[pid][0]
        if group not in resident and not optimizer._swappable_optimizer_subgroup(group):
            return original(param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets)
        # The norm is all stock takes from the buffer here; the gradient itself stays where it is.
        optimizer.norm_for_param_grads[pid] = partition_norm(grad_buffer)
        return None

    optimizer._offload_grad_partition_at_boundary = at_boundary
    if resident:
        _widen_resident_in_update(optimizer, grads, layer, resident)
    return grads


def _widen_resident_in_update(optimizer: ZeroOptimizer, grads: DramGradients, layer: SwapLayer,
                              resident: set[int]) -> None:
    """Resident sub-groups get their fp32 gradients only while the update works on them."""
    pool = layer.pool
    live: dict[int, torch.Tensor] = {}
    flat = optimizer.fp32_partitioned_groups_flat
    for i in resident:
        # Stock's permanent fp32 gradient buffer, 4 bytes per parameter, given back: pinned, it came from the layer's
        # operand pool (memstrata.runtime.swap.pinning), which gets it back; unpinned, dropping it frees it.
        grad = flat[i].grad
        flat[i].grad = None
        if grad is not None:
            layer.pins.unpin(grad)
    layer.pinned_operands.trim()
    prepare, release = optimizer._prepare_sub_group, optimizer._release_sub_group

    def prepare_then_widen(sub_group_id: int, *args: Any, **kwargs: Any) -> Any:
        out = prepare(sub_group_id, *args, **kwargs)
        if sub_group_id in resident:
            stale = live.pop(sub_group_id, None)  # left by a step that failed before its release: widen anew
            if stale is not None:
                pool.free(stale)
            fp32 = flat[sub_group_id]
            buf = pool.tensor(fp32.numel(), torch.float32)
            grads.fill_fp32_gradients(fp32, buf)
            live[sub_group_id] = buf
            fp32.grad = buf
        return out

    def release_then_free(sub_group_id: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return release(sub_group_id, *args, **kwargs)
        finally:
            buf = live.pop(sub_group_id, None)
            if buf is not None:
                flat[sub_group_id].grad = None
                pool.free(buf)

    optimizer._prepare_sub_group = prepare_then_widen
    optimizer._release_sub_group = release_then_free
    _serve_resident_gradients(optimizer, resident)


def _serve_resident_gradients(optimizer: ZeroOptimizer, resident: set[int]) -> None:
    """DeepSpeed's gradient API (`safe_get_full_grad`, `safe_set_full_grad` and their local forms) reads a
    sub-group's fp32 `.grad`, which a resident sub-group has only inside the update: outside it, serve an fp32
    copy widened from the 16-bit flat buffer, and after a set, store the value back there (rounded to its dtype,
    as for streamed sub-groups)."""
    flat = optimizer.fp32_partitioned_groups_flat
    views = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # ds_id -> (fp32 copy served, 16-bit view)
    get_partition = optimizer._get_fp32_grad_state_partition

    def grad_state_partition(param: ZeroParam, release_swap_buffers: bool) -> tuple[torch.Tensor, int]:
        group, _, numel = optimizer.grad_position[optimizer.get_param_id(param)]
        if group in resident and flat[group].grad is None:
            view = views[param.ds_id].narrow(0, 0, numel)
            copy = view.float()
            handed[param.ds_id] = (copy, view)
            return copy, group
        return get_partition(param, release_swap_buffers)

    def storing(setter: Callable[..., None]) -> Callable[..., None]:
        def set_then_store(value: torch.Tensor, param: ZeroParam) -> None:
            setter(value, param)
            served = handed.pop(param.ds_id, None)
            if served is not None:
                served[1].copy_(served[0])

        return set_then_store

    optimizer._get_fp32_grad_state_partition = grad_state_partition
    optimizer.set_fp32_grad_for_param = storing(optimizer.set_fp32_grad_for_param)
    optimizer.set_local_grad_for_param = storing(optimizer.set_local_grad_for_param)
