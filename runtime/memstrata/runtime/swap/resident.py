"""Optimizer sub-groups the plan keeps in DRAM for good: the DRAM budget as a continuum.

ZeRO-3 (DeepSpeed 0.19.8, stage3.py) asks `_swappable_optimizer_subgroup(i)` whether
sub-group i's fp32 master and Adam moments live on NVMe; stock answers from the
size alone, so every sub-group above the swapper's threshold is swapped once any
byte of the optimizer state is offloaded. Here the answer follows the plan: as many whole sub-groups as
the plan's DRAM bytes for optimizer state hold (`SwapSettings.resident_state_bytes`)
are *not* swappable - ZeRO-3 then builds their state as ordinary DRAM tensors, they
own no NVMe extent and move no byte per step - and only the rest streams through
NVMe. A budget that holds everything makes a run with nothing on NVMe at all.

Sub-groups are cut by memstrata's rule (memstrata.plan.accounting.group_tensors: a big
tensor alone, the rest about `sub_group_size` each) instead of stock's, which lets a big
tensor join the tail of the open sub-group; the planner sizes its buffers with the same
rule and the same largest-first choice (`choose_resident`).

The choice has to be in place while ZeRO-3 is being constructed (it creates each
sub-group's fp32 partition in DRAM or on NVMe right then), so the method is
rebound on the class for the duration of `deepspeed.initialize` (`constructing`)
and on the instance after it; the answer is computed once per optimizer from its
sub-group sizes, so it never changes between calls.

With memstrata.runtime.swap.gradients installed, the resident sub-groups' gradients
are not copied into permanent fp32 buffers either (stock keeps one per resident
sub-group, 4 B per parameter): like the streamed ones they are widened from ZeRO-3's
16-bit flat buffer when the update reaches the sub-group, and released after it.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

from memstrata.plan.accounting import STATE_BYTES_PER_ELEMENT, choose_resident, group_tensors
from memstrata.runtime.swap import layer as swaplayer
from memstrata.runtime.swap.protocols import ZeroOptimizer

__all__ = ["deciding", "keep_resident_decision", "resident_ids"]

_ATTR = "memstrata_resident"


def resident_ids(optimizer: Any) -> set[int]:
    """The resident sub-groups of a ZeRO-3 optimizer built under `deciding` (empty for any other)."""
    return set(getattr(optimizer, _ATTR, ()) or ())


def _decider(original: Callable[[Any, int], bool], layer: swaplayer.SwapLayer) -> Callable[[Any, int], bool]:
    def swappable(self: Any, sub_group_id: int) -> bool:
        if not original(self, sub_group_id):
            return False
        kept = getattr(self, _ATTR, None)
        if kept is None:
            numels = [int(n) for n in self.fp16_partitioned_groups_flat_numel]
            can = [bool(original(self, i)) for i in range(len(numels))]
            # Nothing on NVMe: every sub-group stays, whatever rounding the plan's bytes went through.
            budget = (sum(numels) * STATE_BYTES_PER_ELEMENT if layer.settings.no_nvme
                      else layer.settings.resident_state_bytes)
            kept = choose_resident(numels, budget, can)
            setattr(self, _ATTR, kept)
            layer.resident_subgroups = len(kept)
            layer.resident_state_bytes = sum(numels[i] for i in kept) * STATE_BYTES_PER_ELEMENT
        return sub_group_id not in kept

    return swappable


def _grouper(self: Any, params_group: list[Any]) -> list[list[Any]]:
    sizes = [int(p.partition_numel()) for p in params_group]
    return [[params_group[i] for i in g] for g in group_tensors(sizes, int(self.sub_group_size))]


def _lean_state_init(original: Callable[[Any], None], layer: swaplayer.SwapLayer) -> Callable[[Any], None]:
    """ZeRO-3's `initialize_optimizer_states`, without what memstrata's engine never uses.

    Stock walks every sub-group once at construction: it zeroes an fp32 gradient buffer of the largest sub-group
    (4 B x the embedding), swaps each NVMe sub-group's master in whole and out again, re-writes its 16-bit
    partitions from it (the same values), and gives each resident sub-group a permanent fp32 gradient buffer
    (4 B per resident parameter) that memstrata.runtime.swap.gradients frees right after. With Adam (whose state
    appears at its first step), memstrata's optimizer swapper and DRAM gradients, nothing of that is read before
    the first update, which widens each sub-group's gradients itself: the walk is skipped, and with it those
    transients; only the sub-groups too small to swap, which keep stock's gradient path, get its buffer. Any other
    optimizer (Adagrad builds its state here), Muon, or stock's gradient path everywhere: stock's walk."""
    def initialize_optimizer_states(self: Any) -> None:
        import torch
        from deepspeed.accelerator import get_accelerator

        lean = (layer.settings.dram_gradients and self.offload_optimizer and not self.use_muon
                and getattr(getattr(self, "optimizer_swapper", None), "layer", None) is layer  # memstrata's
                and not isinstance(self.optimizer, torch.optim.Adagrad))
        if not lean:
            original(self)
            return
        resident = resident_ids(self)
        for i, flat in enumerate(self.fp32_partitioned_groups_flat):
            if i in resident or self._swappable_optimizer_subgroup(i):
                continue
            # Too small to swap (under min_swap_bytes) and not the plan's: stock's gradient path, and its buffer.
            grad = torch.zeros(int(self.fp16_partitioned_groups_flat_numel[i]), dtype=flat.dtype, device=self.device)
            if self.offload_optimizer_pin_memory:
                grad = get_accelerator().pin_memory(grad)
            flat.grad = grad.to(self.subgroup_to_device[i])

    return initialize_optimizer_states


@contextlib.contextmanager
def deciding(layer: swaplayer.SwapLayer) -> Iterator[None]:
    """While ZeRO-3 is constructed: sub-groups are cut by memstrata's rule, their swappability follows the
    layer's resident budget, and the optimizer's construction walk is skipped where nothing uses it."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3

    original, cut, walk = (Z3._swappable_optimizer_subgroup, Z3._create_fp16_sub_groups,
                           Z3.initialize_optimizer_states)
    Z3._swappable_optimizer_subgroup = _decider(original, layer)
    Z3._create_fp16_sub_groups = _grouper
    Z3.initialize_optimizer_states = _lean_state_init(walk, layer)
    try:
        yield
    finally:
        Z3._swappable_optimizer_subgroup, Z3._create_fp16_sub_groups = original, cut
        Z3.initialize_optimizer_states = walk


def keep_resident_decision(optimizer: ZeroOptimizer, layer: swaplayer.SwapLayer) -> None:
    """After construction: the instance keeps answering as it was built (the class method is stock again)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3

    optimizer._swappable_optimizer_subgroup = types.MethodType(  # type: ignore[method-assign]
        _decider(Z3._swappable_optimizer_subgroup, layer), optimizer)
