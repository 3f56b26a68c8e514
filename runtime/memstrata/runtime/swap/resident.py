"""Optimizer sub-groups the plan keeps in DRAM for good: the DRAM budget as a continuum.

ZeRO-3 (DeepSpeed 0.19.8, stage3.py) asks `_swappable_optimizer_subgroup(i)` whether
sub-group i's fp32 master and Adam moments live on NVMe; stock answers from the
size alone, so every sub-group above 1 MiB is swapped once any byte of the optimizer
state is offloaded. Here the answer follows the plan: as many whole sub-groups as
the plan's DRAM bytes for optimizer state hold (`SwapSettings.resident_state_bytes`)
are *not* swappable - ZeRO-3 then builds their state as ordinary DRAM tensors, they
own no NVMe extent and move no byte per step - and only the rest streams through
NVMe. A budget that holds everything makes a run with nothing on NVMe at all.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from memstrata.runtime.swap import layer as swaplayer
from memstrata.runtime.swap.protocols import ZeroOptimizer

__all__ = ["STATE_BYTES_PER_ELEMENT", "choose_resident", "deciding", "keep_resident_decision", "resident_ids",
           "state_bytes"]

# fp32 master weights and the two Adam moments.
STATE_BYTES_PER_ELEMENT = 12
_ATTR = "memstrata_resident"


def state_bytes(numel: int) -> int:
    """DRAM bytes of one resident sub-group's optimizer state (master + moments): ZeRO-3 builds a resident
    sub-group's tensors at their exact size (only swapped ones are padded to the swapper's alignment), so a
    budget of the plan's 12 bytes per parameter holds every sub-group."""
    return numel * STATE_BYTES_PER_ELEMENT


def choose_resident(numels: Sequence[int], swappable: Sequence[bool], budget_bytes: int | None) -> set[int]:
    """Ids of the swappable sub-groups to keep in DRAM: largest first (ties by id) while their state fits in
    `budget_bytes` (None: none), so the ones that stream are the small ones and their buffers small - the
    order memstrata.plan.accounting.streamed_subgroup_bytes plans with. Pure. Sub-groups that are not
    swappable anyway (too small for the swapper) stay in DRAM without taking budget."""
    if not budget_bytes:
        return set()
    left, kept = budget_bytes, set()
    for i in sorted(range(len(numels)), key=lambda g: (-numels[g], g)):
        n, can_swap = numels[i], swappable[i]
        if can_swap and state_bytes(n) <= left:
            kept.add(i)
            left -= state_bytes(n)
    return kept


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
            kept = choose_resident(numels, can, layer.settings.resident_state_bytes)
            setattr(self, _ATTR, kept)
            layer.resident_subgroups = len(kept)
            layer.resident_state_bytes = sum(state_bytes(numels[i]) for i in kept)
        return sub_group_id not in kept

    return swappable


@contextlib.contextmanager
def deciding(layer: swaplayer.SwapLayer) -> Iterator[None]:
    """While ZeRO-3 is constructed: sub-group swappability follows the layer's resident budget."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3

    original = Z3._swappable_optimizer_subgroup
    Z3._swappable_optimizer_subgroup = _decider(original, layer)
    try:
        yield
    finally:
        Z3._swappable_optimizer_subgroup = original


def keep_resident_decision(optimizer: ZeroOptimizer, layer: swaplayer.SwapLayer) -> None:
    """After construction: the instance keeps answering as it was built (the class method is stock again)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3

    optimizer._swappable_optimizer_subgroup = types.MethodType(  # type: ignore[method-assign]
        _decider(Z3._swappable_optimizer_subgroup, layer), optimizer)
