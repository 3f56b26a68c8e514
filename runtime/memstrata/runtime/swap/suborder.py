"""Sub-group order reversed every optimizer step, the last K kept in DRAM (MLP-Offload).

ZeRO-3's `step()` (DeepSpeed 0.19.8, stage3.py) updates sub-groups in one
fixed loop, `for sub_group_id, group in enumerate(self.fp16_groups)`, whose
body calls the per-sub-group methods of `seam.STEP_LOOP` in turn,
`_prepare_sub_group` first and `_release_sub_group` last (seamcheck.verify checks
that the installed DeepSpeed's loop still calls exactly those).
Rather than copy `step()`, the hook wraps those methods on the optimizer
*instance* so that, inside the loop only, the loop's position p is read as
sub-group `order[p]`. The loop is entered at the first `_prepare_sub_group`
of a step (Muon's pre-loop calls of `_muon_update_lacks_loss_scale` use real
ids) and left when `step()` returns; checkpoint paths that call the same
methods outside `step()` are untouched.

With the order reversed each step, the K sub-groups updated last in step i
are the first K of step i+1: the optimizer swapper keeps exactly those in
DRAM (its `keep` set) and writes every other one back to NVMe.

Where the update runs beside the next forward (memstrata.runtime.swap.overlap),
the order is fixed instead, the forward's, so the forward's first layers are
updated first; the K kept are then the first K, which the next update starts
on without reading while the read-ahead fetches what follows.

The same walk drives the pipelined update (memstrata.runtime.swap.readahead):
the swapper is told this step's swappable sub-groups in order before the loop,
and the pipeline is drained right after the loop's last `_release_sub_group`
(so the state is on NVMe, and no I/O token held, before `_post_step`'s
collectives), or when `step()` leaves early or raises.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memstrata.runtime.swap.protocols import ZeroOptimizer
from memstrata.runtime.swap.seam import STEP_LOOP

if TYPE_CHECKING:
    from memstrata.runtime.swap.optimizer import MemstrataOptimizerSwapper

__all__ = ["install_reversing_order", "SubGroupOrder"]


class SubGroupOrder:
    """Per-optimizer state of the hook: this step's order, whether the loop is running, what was walked."""

    def __init__(self, groups: int, cache_slots: int, fixed: list[int] | None = None) -> None:
        self.groups, self.cache_slots, self.fixed = groups, cache_slots, fixed
        self.order: list[int] = list(range(groups))
        self.in_loop = False
        self.history: list[list[int]] = []  # sub-group ids in update order, per walk (a few ints per step)

    def next_order(self) -> list[int]:
        """The reverse of the last walk. Counted in walks, not calls: a step skipped on overflow walks nothing.
        A fixed order (the overlapped update's: the forward's) is every step's."""
        if self.fixed is not None:
            self.order = list(self.fixed)
            return self.order
        forward = list(range(self.groups))
        self.order = forward if len(self.history) % 2 == 0 else forward[::-1]
        return self.order

    def keep(self, swappable: Callable[[int], bool]) -> list[int]:
        """Sub-groups to leave in DRAM this step: the last K swapped ones walked (the first K of the next step).
        Sub-groups too small to swap stay in DRAM anyway and must not take a cache slot."""
        candidates = [g for g in self.order if swappable(g)]
        if self.fixed is not None:  # the same first K every step: the next update starts on them, unread
            return candidates[:self.cache_slots]
        return candidates[len(candidates) - min(self.cache_slots, len(candidates)):] if self.cache_slots else []


def install_reversing_order(optimizer: ZeroOptimizer, swapper: MemstrataOptimizerSwapper,
                            cache_slots: int, fixed: list[int] | None = None) -> SubGroupOrder:
    """Wrap `optimizer.step` and the loop's per-sub-group methods; tell `swapper` which ids to keep each step.

    The loop's calls (seam.STEP_LOOP) and every other name used here are checked by memstrata.runtime.swap.seam
    before initialize."""
    state = SubGroupOrder(len(optimizer.fp16_groups), cache_slots, fixed)

    def translated(name: str) -> None:
        original = getattr(optimizer, name)  # what the instance has now: the class's, or a wrapper installed first

        @functools.wraps(original)
        def call(sub_group_id: int, *args: Any, **kwargs: Any) -> Any:
            if name == "_prepare_sub_group" and not state.in_loop and stepping[0]:
                state.in_loop = True
                state.history.append([])
            last = state.in_loop and name == "_release_sub_group" and sub_group_id == state.groups - 1
            if state.in_loop:
                sub_group_id = state.order[sub_group_id]
                if name == "_prepare_sub_group":
                    state.history[-1].append(sub_group_id)
            out = original(sub_group_id, *args, **kwargs)
            if last:
                swapper.readahead.finish()
            return out

        setattr(optimizer, name, call)

    stepping = [False]
    for name in STEP_LOOP:
        translated(name)
    original_step = optimizer.step

    @functools.wraps(original_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        state.next_order()
        swappable = optimizer._swappable_optimizer_subgroup
        flat = optimizer.fp32_partitioned_groups_flat
        sliced = swapper.readahead.never_read  # updated a slice at a time: never whole in DRAM, never cached
        swapper.keep_ids = {optimizer.get_param_id(flat[g]) for g in
                            state.keep(lambda g: swappable(g) and optimizer.get_param_id(flat[g]) not in sliced)}
        swapper.readahead.begin([flat[g] for g in state.order if swappable(g)])
        stepping[0] = True
        failed = True
        try:
            out = original_step(*args, **kwargs)
            failed = False
            return out
        finally:
            stepping[0] = False
            state.in_loop = False
            try:
                swapper.readahead.finish()  # an overflow-skipped or failed step: nothing read ahead stays
            except Exception:
                if not failed:
                    raise  # else the step's own error is the one to report

    optimizer.step = step
    return state
