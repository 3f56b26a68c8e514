"""The delayed update (ZeRO-Offload's DPU), only where a job asks for it by name (`spec.training.update: delayed`).

Step t's update runs beside step t+1's forward *and* backward, so its I/O and Adam hide behind a whole step of
compute instead of only the forward (memstrata.runtime.swap.overlap). The one numerical change, and the one the
name asks for: step t+1's gradient is taken at the weights from before step t's update (one step stale). The
update itself is ZeRO-3's (its clip norm, its Adam, its 16-bit rounding), on step t's own gradients.

What keeps it exact to that definition beside the backward, with no second copy of the gradients:
- The backward writes a sub-group's gradients (`partition_grads`) only once the update has read that sub-group's
  (its swap-in widens them into the update's own fp32 buffer: `consumed`). The update walks the sub-groups in the
  order the backward reaches them (`backward_order`), so the backward waits only where the update falls behind.
- The update writes a sub-group's new 16-bit weights where the forward and backward read them only once the
  backward has written every gradient of that sub-group at the step's last micro-step (`used`: the weights are
  read no more before the next step). Before that it writes them into a shadow of the sub-group's partition,
  copied in when the sub-group is used or when the update is joined. At most the trained 16-bit weights once more:
  the planner counts that with the weights (memstrata.plan.accounting.category_bytes).
- The update is joined, its shadows copied in, at the next `step()`, and before anything else reads the weights
  or the optimizer's state outside a training pass: a gather outside forward..backward (an evaluation in eval
  mode, a model save), a checkpoint's save or load, `state_dict`, `destroy`. A checkpoint holds its update
  applied, so a run resumed from it goes on exactly as the run that saved it.

On top of the beside-the-forward update's refusals it is refused where 16-bit partitions are on the accelerator
(the shadows would take its memory, which the plan does not count). A sub-group whose gradients the update reads
past its swap-in (sliced, or one stock ZeRO-3 keeps whole in DRAM with an fp32 gradient buffer the backward copies
into) is written by the backward only after its release.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any

import torch

from memstrata.runtime.swap.overlap import OverlappedUpdate
from memstrata.runtime.swap.protocols import Engine, ZeroOptimizer
from memstrata.runtime.swap.status import OverlapStatus

__all__ = ["DelayedUpdate", "backward_order", "delayed_refusal", "read_until_release"]


def backward_order(opt: ZeroOptimizer) -> list[int]:
    """Sub-group ids in the order the backward first writes their gradients: by their latest parameter in the
    module's order, latest first (a sub-group of every layer's biases and norms comes first; a tied embedding,
    whose gradient is complete only at the end, last)."""
    position = {id(p): i for i, p in enumerate(opt.module.parameters())}

    def last_use(g: int) -> int:
        return max((position.get(id(p), -1) for p in opt.fp16_groups[g]), default=-1)

    return sorted(range(len(opt.fp16_groups)), key=lambda g: (-last_use(g), g))


def delayed_refusal(opt: ZeroOptimizer) -> str | None:
    """Why the delayed update cannot run here (beyond memstrata.runtime.swap.overlap.refusal), or None."""
    flats = [f for f in opt.fp16_partitioned_groups_flat if f is not None]
    if any(f.device.type != "cpu" for f in flats):
        return "16-bit weights on the accelerator: the delayed update's shadows would take its memory"
    return None


def read_until_release(opt: ZeroOptimizer, sliced: Iterable[int], resident: set[int]) -> frozenset[int]:
    """Sub-groups whose gradients the update reads after their swap-in, until their release: the sliced ones
    (widened a slice at a time) and those kept whole in DRAM by stock ZeRO-3 (neither streamed nor resident: the
    backward copies their gradients into the fp32 buffer the update reads)."""
    kept = {g for g in range(len(opt.fp16_groups)) if g not in resident and not opt._swappable_optimizer_subgroup(g)}
    return frozenset(sliced) | kept


class DelayedUpdate(OverlappedUpdate):
    """The hooks of one ZeRO-3 optimizer's delayed update (see the module). `sliced`: the sub-groups the sliced
    update casts slice by slice (memstrata.runtime.swap.sliced); `late`: those whose gradients it reads until their
    release (`read_until_release`)."""

    def __init__(self, opt: ZeroOptimizer, accelerator: Any = None, sliced: Iterable[int] = (),
                 late: Iterable[int] = ()) -> None:
        super().__init__(opt, accelerator)
        self.order = backward_order(opt)
        self.sliced = frozenset(sliced)
        self.late = frozenset(late) | self.sliced
        self.lock = threading.Lock()  # `used`, the shadows and the redirections, between update and backward
        groups = opt.fp16_groups
        self.trained = [sum(1 for p in group if p.requires_grad) for group in groups]
        self.written: list[set[int]] = [set() for _ in groups]
        self.used: set[int] = set()
        self.redirected: dict[int, torch.Tensor] = {}  # sub-group -> its real partition, while a shadow stands in
        self.shadows: dict[int, torch.Tensor] = {}
        self.in_pass = False
        self.backward_waits = self.late_subgroups = self.shadow_bytes = self.shadow_peak_bytes = 0
        self.backward_wait_seconds = 0.0

    def report(self) -> OverlapStatus:
        return super().report().model_copy(update={
            "mode": "delayed", "backward_waits": self.backward_waits,
            "backward_wait_seconds": round(self.backward_wait_seconds, 3), "late_subgroups": self.late_subgroups,
            "shadow_peak_bytes": self.shadow_peak_bytes})

    # -- the update thread: consumed gradients, 16-bit weights into shadows ---------------------------------
    def wrap_loop(self) -> None:
        opt = self.opt
        prepare, reassign = opt._prepare_sub_group, opt._reassign_or_swap_out_partitioned_parameters
        release, unflatten = opt._release_sub_group, opt._unflatten_partitioned_parameters

        @functools.wraps(prepare)
        def prepare_then_consume(sub_group_id: int, *args: Any, **kwargs: Any) -> Any:
            u = self._mine()
            if u is None:
                return prepare(sub_group_id, *args, **kwargs)
            u.looping.set()
            if sub_group_id in self.sliced:  # its slices are cast into the 16-bit partition inside the update
                self._redirect(sub_group_id)
            out = prepare(sub_group_id, *args, **kwargs)
            if sub_group_id not in self.late:  # the swap-in widened its gradients: the backward may write them
                u.done[sub_group_id].set()
            return out

        @functools.wraps(reassign)
        def reassign_into_shadow(sub_group_id: int) -> Any:
            if self._mine() is None:
                return reassign(sub_group_id)
            self._redirect(sub_group_id)
            try:
                return reassign(sub_group_id)
            finally:
                self._restore(sub_group_id)

        @functools.wraps(release)
        def release_then_consume(sub_group_id: int, *args: Any, **kwargs: Any) -> Any:
            try:
                return release(sub_group_id, *args, **kwargs)
            finally:
                u = self._mine()
                if u is not None:
                    u.done[sub_group_id].set()

        @functools.wraps(unflatten)
        def unflatten_unless_shadowed(sub_group_id: int) -> Any:
            # The parameters keep pointing at their real partition while a shadow stands in for it.
            if sub_group_id in self.redirected and self._mine() is not None:
                return None
            return unflatten(sub_group_id)

        opt._prepare_sub_group = prepare_then_consume
        opt._reassign_or_swap_out_partitioned_parameters = reassign_into_shadow
        opt._release_sub_group = release_then_consume
        opt._unflatten_partitioned_parameters = unflatten_unless_shadowed

    def _redirect(self, g: int) -> None:
        """Before the update writes sub-group g's 16-bit weights: a shadow stands in for its partition unless the
        backward is done with it."""
        flats = self.opt.fp16_partitioned_groups_flat
        with self.lock:
            real = flats[g]
            if g in self.used or g in self.redirected or real is None:
                return
            self.redirected[g] = real
            flats[g] = torch.empty_like(real)

    def _restore(self, g: int) -> None:
        """After: the real partition back in place; the shadow copied in now (the backward passed meanwhile) or
        kept until it does."""
        flats = self.opt.fp16_partitioned_groups_flat
        with self.lock:
            real = self.redirected.pop(g, None)
            if real is None:
                return
            shadow, flats[g] = flats[g], real
            assert shadow is not None
            self.late_subgroups += 1
            if g in self.used:
                real.copy_(shadow)
                return
            self.shadows[g] = shadow
            self.shadow_bytes += shadow.numel() * shadow.element_size()
            self.shadow_peak_bytes = max(self.shadow_peak_bytes, self.shadow_bytes)

    # -- the backward: waits for consumed gradients, marks used weights ---------------------------------------
    def _wait_consumed(self, params: Iterable[Any]) -> None:
        waited = self.wait_done(params)  # `done`, here: the sub-group's gradients read
        if waited is not None:
            self.backward_wait_seconds += waited
            self.backward_waits += 1

    def _mark_written(self, params: Iterable[Any]) -> None:
        flats = self.opt.fp16_partitioned_groups_flat
        with self.lock:
            for p in params:
                g = self.subgroup_of.get(id(p), -1)
                if g < 0 or g in self.used:
                    continue
                self.written[g].add(id(p))
                if len(self.written[g]) >= self.trained[g]:
                    self.used.add(g)
                    shadow = self.shadows.pop(g, None)
                    if shadow is not None:
                        self._copy_in(flats[g], shadow)

    def _copy_in(self, real: torch.Tensor | None, shadow: torch.Tensor) -> None:
        assert real is not None
        real.copy_(shadow)
        self.shadow_bytes -= shadow.numel() * shadow.element_size()

    def wrap_params(self) -> None:
        """Gathers outside a training pass join first; the backward's gradient writes wait and mark."""
        super().wrap_params()
        inner = self.opt.partition_grads

        @functools.wraps(inner)
        def partition_grads(params_to_release: list[Any], grad_partitions: list[torch.Tensor]) -> Any:
            self._wait_consumed(params_to_release)
            out = inner(params_to_release, grad_partitions)
            if self.opt.is_gradient_accumulation_boundary():
                self._mark_written(params_to_release)
            return out

        self.opt.partition_grads = partition_grads

    def before_gather(self, params: Iterable[Any]) -> None:
        """Inside a training pass a gather reads the weights as they are (the step before's); outside one (an
        evaluation, a save) the update is joined first, so it reads them as of the last step, applied."""
        if not self.in_pass:
            self.join()

    # -- the main thread ---------------------------------------------------------------------------------------
    def wrap_step(self) -> None:
        super().wrap_step()
        launch, real_reset = self.opt.step, self.opt.reset_cpu_buffers

        def reset_outside_update() -> None:
            # ZeRO-3 clears the recorded gradient norms after its loop; beside the backward that would clear the
            # next step's. The main thread clears them once the step has read them (below).
            if self._mine() is None:
                real_reset()

        @functools.wraps(launch)
        def step(*args: Any, **kwargs: Any) -> None:
            self.join()
            with self.lock:
                self.written = [set() for _ in self.written]
                self.used = set()
            launch(*args, **kwargs)
            real_reset()

        self.opt.reset_cpu_buffers = reset_outside_update
        self.opt.step = step

    def join(self) -> None:
        if self._mine() is not None:
            return
        try:
            super().join()
        finally:
            self._apply_all()

    def _apply_all(self) -> None:
        """Every shadow copied in; a redirection left by a failed update undone (its shadow dropped)."""
        flats = self.opt.fp16_partitioned_groups_flat
        with self.lock:
            for g, real in self.redirected.items():
                flats[g] = real
            self.redirected.clear()
            for g, shadow in self.shadows.items():
                self._copy_in(flats[g], shadow)
            self.shadows.clear()

    def wrap_engine(self, engine: Engine) -> None:
        """A training forward opens a pass, the backward closes it; an eval-mode forward joins first, and so does
        whatever else reads the optimizer's state."""
        forward, backward = engine.forward, engine.backward

        @functools.wraps(forward)
        def forward_in_pass(*args: Any, **kwargs: Any) -> Any:
            if engine.module.training:
                self.in_pass = True
            else:
                self.join()
            return forward(*args, **kwargs)

        @functools.wraps(backward)
        def backward_ends_pass(*args: Any, **kwargs: Any) -> Any:
            try:
                return backward(*args, **kwargs)
            finally:
                self.in_pass = False

        engine.forward, engine.backward = forward_in_pass, backward_ends_pass
        self.join_before_readers(engine)

