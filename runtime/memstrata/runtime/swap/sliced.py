"""Adam over a sub-group larger than the streamed ones, a slice at a time: no tensor forces its state into DRAM.

memstrata cuts ZeRO-3's optimizer sub-groups by memstrata.plan.accounting.group_tensors, so a tensor of at least
the unit (the embedding, an untied LM head) forms a sub-group alone, however large. Streamed whole it needs
buffers of its size (12 B x its elements of state and 4 B of gradient: 617 MB for GPT-2's embedding, 4 GiB for
Llama-3.2-1B's), so the vocabulary, not the budget, would set the locked-buffer floor. Here such a sub-group
(one tensor, more than `slice_elements`) is updated in slices of `slice_elements`
(memstrata.plan.accounting.slice_elements). One kept in DRAM for good (memstrata.runtime.swap.resident) is updated
in place, slice by slice, so only a slice's fp32 gradient is widened at once; one on NVMe, each slice:

- read: its fp32 master and Adam moments, from the parts of their extents (memstrata.runtime.strata.nvmeio.part_of;
  on the first step only the master: the moments start at zero, as DeepSpeedCPUAdam starts them);
- updated by ZeRO-3's own `unscale_and_clip_grads` and `_optimizer_step`, on a stand-in parameter whose data,
  gradient (widened from ZeRO-3's 16-bit buffer, memstrata.runtime.swap.gradients) and Adam state are the slice's;
- cast to the 16-bit partition: in place where it is in DRAM, else written to the part of its extent;
- written back to the parts of the state's extents.
The next slice is read while one is updated (with `prefetch_subgroups` > 0), and its write-back completes behind
the next one's update: at most three slices' buffers (one read ahead, one updated, one written) exist at once, so
the update's locked buffers are bounded by the slice, whatever the tensor
(`memstrata.plan.buffers.update_buffer_bytes` counts them).

Exact: the unscale, Adam and the cast are elementwise; DeepSpeedCPUAdam's bias correction depends only on the step
(calls with the same step leave its beta^t as it is); slices are whole multiples of 2048 elements, so no element
moves between its vector loop and its scalar tail. The weights and the state after a step are bit for bit those of
the sub-group updated whole (tests/offload/test_sliced_update.py).

The hook wraps the loop's per-sub-group methods (memstrata.runtime.swap.seam.STEP_LOOP) on the optimizer instance,
as memstrata.runtime.swap.gradients does, and is installed before memstrata.runtime.swap.suborder, whose wrappers
call these with real sub-group ids; outside `step()` they are stock's. A checkpoint reads and writes a sliced
sub-group whole, through ZeRO-3's own swap-in (train.checkpoints.engine_state): the state's extents are the whole
tensors', so that works unchanged, but it stages the whole sub-group (16 B x its elements) while it does, a transient
beyond the update's buffers that the plan does not count.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus

from memstrata.runtime.swap.adamstate import ADAM_STATE, name_state, zero_started_adam
from memstrata.runtime.swap.protocols import ZeroOptimizer
from memstrata.runtime.swap.resident import resident_ids

if TYPE_CHECKING:
    from memstrata.runtime.swap.gradients import DramGradients
    from memstrata.runtime.swap.handle import ExtentSwapHandle
    from memstrata.runtime.swap.layer import SwapLayer
    from memstrata.runtime.swap.optimizer import MemstrataOptimizerSwapper

__all__ = ["SlicedUpdate", "install_sliced_update"]

class _Slice:
    """One slice's buffers: fp32 master and moments (12 B/element), then its gradient (4 B), which after Adam
    holds the 16-bit cast that is written to NVMe."""

    def __init__(self, start: int, length: int, io_length: int, buffers: list[torch.Tensor]) -> None:
        self.start, self.length, self.io_length = start, length, io_length
        self.buffers = buffers  # master, exp_avg, exp_avg_sq (+ gradient once current)

    def view(self, k: int) -> torch.Tensor:
        return self.buffers[k].narrow(0, 0, self.length)


class SlicedUpdate:
    """The sliced sub-groups of one ZeRO-3 optimizer and the handles their slices move through."""

    def __init__(self, zero: ZeroOptimizer, swapper: MemstrataOptimizerSwapper, grads: DramGradients,
                 layer: SwapLayer, slice_elements: int) -> None:
        self.zero, self.swapper, self.grads, self.layer = zero, swapper, grads, layer
        self.slice = slice_elements
        # One slice read ahead while one is updated, as the streamed sub-groups are (prefetch_subgroups); with 0,
        # each is read when it is needed and only the write-back overlaps (memstrata.plan.accounting counts both).
        self.depth = min(1, layer.settings.prefetch_subgroups)
        resident = resident_ids(zero)
        self.ids = {i for i in range(len(zero.fp16_groups)) if self._sliceable(i, resident)}
        # Those kept in DRAM for good: their state is updated in place a slice at a time, so only a slice's
        # gradient is widened at once (4 B x the embedding otherwise, held in the pool for the run).
        self.resident = self.ids & resident
        self._readers = [layer.handle("optimizer"), layer.handle("optimizer")] if self.ids else []
        self._writer = layer.handle("optimizer") if self.ids else None
        self._half_writer = layer.handle("param") if self.ids else None
        self.active: int | None = None
        self.slices_updated = 0
        # The loop's methods as they were before this hook: what the sliced path runs per slice.
        self._unscale = zero.unscale_and_clip_grads
        self._step = zero._optimizer_step

    def _sliceable(self, i: int, resident: set[int]) -> bool:
        z = self.zero
        # Only DeepSpeedCPUAdam's step is elementwise with a bias correction that a repeated step leaves alone;
        # torch autocast's GradScaler steps (and moves its scale) per call, and ZenFlow has a step of its own.
        return ((i in resident or bool(z._swappable_optimizer_subgroup(i))) and len(z.fp16_groups[i]) == 1
                and int(z.fp16_partitioned_groups_flat_numel[i]) > self.slice and zero_started_adam(z.optimizer)
                and z.torch_autocast_gradscaler is None and not getattr(z, "zenflow", False))

    def param_ids(self) -> set[str]:
        """The sliced sub-groups' fp32 ids (the swapper's keys): never read ahead whole, never cached."""
        return {self.zero.get_param_id(self.zero.fp32_partitioned_groups_flat[i]) for i in self.ids - self.resident}

    # -- one sub-group ----------------------------------------------------------------------------
    def update(self, i: int, total_norm: Any) -> None:
        """Unscale, Adam, 16-bit cast and write-back of sub-group i, slice by slice (see the module)."""
        if i in self.resident:
            return self._update_resident(i, total_norm)
        z, sw = self.zero, self.swapper
        fp32 = z.fp32_partitioned_groups_flat[i]
        info = sw._get_param_swap_info(fp32)
        if info is None:
            raise RuntimeError(f"sub-group {i} is sliced but its optimizer swapper has no record of it")
        sw.readahead.settle()  # the previous sub-group's write-back: its buffers back before these are taken
        if not info.has_state_tensors:
            self._register_state(fp32, info)
        state = z.optimizer.state[fp32]
        # The moments start at zero until a whole update has written them ("step" is set only then). A step that
        # fails half-way leaves its first slices updated on NVMe: like any failed step, the run ends there and
        # resumes from its last checkpoint.
        first, step = "step" not in state, int(state.get("step", 0))
        paths = info.get_swap_paths()
        n, aligned = info.numel(), sw._io_aligned_numel(info.numel())
        starts = list(range(0, n, self.slice))
        assert starts, "a sliced sub-group has more elements than a slice"
        reading: _Slice | None = None
        cur: _Slice | None = None
        writing: list[_Slice] = []
        try:
            for k in range(len(starts)):
                if reading is None:  # not read ahead (the first slice, or no read-ahead at all)
                    reading = self._read(starts[k], n, aligned, paths, first, k % 2)
                cur, reading = reading, None
                self._readers[k % 2].wait()
                if k + 1 < len(starts):
                    if self.depth:
                        reading = self._read(starts[k + 1], n, aligned, paths, first, (k + 1) % 2)
                else:
                    sw.readahead.top_up(fp32)  # the next sub-groups' reads, under the last slice's update
                cur.buffers.append(self.swapper.swap_buffer_manager.allocate(self.slice, 1, torch.float32)[0])
                new_step = self._adam(i, cur, fp32, step, total_norm)
                self._finish_write(writing)
                writing, cur = [cur], None
                self._write_state(writing[0], paths)
                self._cast16(i, writing[0])
            self._finish_write(writing)
        except BaseException:
            self._abandon([reading, cur, *writing])
            raise
        state["step"] = new_step

    def _update_resident(self, i: int, total_norm: Any) -> None:
        """Sub-group i's state is in DRAM: each slice's master and moments are views of it, updated in place; only
        the gradient is widened a slice at a time. The moments are created whole first, as DeepSpeedCPUAdam's
        first step creates them (zeros)."""
        fp32 = self.zero.fp32_partitioned_groups_flat[i]
        state = self.zero.optimizer.state[fp32]
        if not state:
            state.update(step=0, **{name: torch.zeros_like(fp32.data) for name in ADAM_STATE})
        step, new_step, n = int(state["step"]), int(state["step"]), fp32.numel()
        grad = self.swapper.swap_buffer_manager.allocate(self.slice, 1, torch.float32)[0]
        try:
            for start in range(0, n, self.slice):
                length = min(self.slice, n - start)
                views = [t.data.narrow(0, start, length) for t in (fp32, *(state[name] for name in ADAM_STATE))]
                s = _Slice(start, length, length, [*views, grad])
                new_step = self._adam(i, s, fp32, step, total_norm)
                self._cast16(i, s)
                if self._half_writer is not None:
                    self._half_writer.wait()  # the cast in `grad`'s bytes is written before the next slice widens
        finally:
            self.swapper.swap_buffer_manager.free([grad])
        state["step"] = new_step

    def _register_state(self, fp32: torch.Tensor, info: Any) -> None:
        """Before the first update: the moments' records and extents, as stock makes them from DeepSpeedCPUAdam's
        first step (`_get_state_tensors`), but sized on NVMe only."""
        state = self.zero.optimizer.state[fp32]
        tensors = [state.setdefault(name, name_state(torch.empty(0, dtype=torch.float32), fp32, name))
                   for name in ADAM_STATE]
        info.add_state_tensors(tensors)
        nbytes = self.swapper._io_aligned_numel(info.numel()) * 4
        assert self._writer is not None
        for path in info.get_swap_paths()[1:]:
            self._writer.reserve(path, nbytes)

    def _read(self, start: int, n: int, aligned: int, paths: list[str], first: bool, which: int) -> _Slice:
        buffers = self.swapper.swap_buffer_manager.allocate(self.slice, 3, torch.float32)
        s = _Slice(start, min(self.slice, n - start), min(self.slice, aligned - start), buffers)
        reader = self._readers[which]
        try:
            for buf, path in zip(buffers[: 1 if first else 3], paths):
                reader.read_part(buf.narrow(0, 0, s.io_length), path, start * 4)
            if first:
                for buf in buffers[1:]:
                    buf.narrow(0, 0, s.io_length).zero_()
        except BaseException:
            self._drain(reader)
            self.swapper.swap_buffer_manager.free(buffers)
            raise
        return s

    def _adam(self, i: int, s: _Slice, fp32: torch.Tensor, step: int, total_norm: Any) -> int:
        """ZeRO-3's unscale and optimizer step on sub-group i with slice `s` standing in for its fp32 tensor."""
        z = self.zero
        grad = s.buffers[3]
        self.grads.fill_fp32_range(fp32, grad, s.start, s.length)
        stand_in = torch.empty(0, dtype=torch.float32)
        stand_in.data = s.view(0)
        stand_in.grad = grad.narrow(0, 0, s.length)
        z.fp32_partitioned_groups_flat[i] = stand_in
        z.optimizer.state[stand_in] = {"step": step, **{name: s.view(k) for k, name in enumerate(ADAM_STATE, 1)}}
        try:
            self._unscale(i, total_norm)
            self._step(i)
        finally:
            z.fp32_partitioned_groups_flat[i] = fp32
            done = z.optimizer.state.pop(stand_in, {})
        self.slices_updated += 1
        return int(done.get("step", step))

    def _write_state(self, s: _Slice, paths: list[str]) -> None:
        """Submit slice `s`'s state writes."""
        assert self._writer is not None
        for buf, path in zip(s.buffers[:3], paths):
            self._writer.write_part(buf.narrow(0, 0, s.io_length), path, s.start * 4)

    def _cast16(self, i: int, s: _Slice) -> None:
        """Slice `s`'s master into the 16-bit partition: in place where it is in DRAM, else submitted to its
        extent from the gradient's spent bytes."""
        assert self._half_writer is not None
        z = self.zero
        flat16 = z.fp16_partitioned_groups_flat[i]
        if flat16 is not None:
            flat16.narrow(0, s.start, s.length).copy_(s.view(0))
            return
        part = z.fp16_partitioned_groups[i][0]
        if part.status == PartitionedParamStatus.AVAILABLE:  # the partition is in DRAM (a resident weight)
            part.data.view(-1).narrow(0, s.start, s.length).copy_(s.view(0))
            return
        param = z.fp16_groups[i][0]
        swapper = param.nvme_swapper
        path = swapper.id_to_path[param.ds_id]
        half = s.buffers[3].view(swapper.dtype)  # the gradient's bytes, spent: twice the elements in 16 bits
        stored = swapper._io_aligned_numel(swapper.param_id_to_numel[param.ds_id])
        length = min(self.slice, stored - s.start)
        half.narrow(0, 0, s.length).copy_(s.view(0))
        self._half_writer.write_part(half.narrow(0, 0, length), path, s.start * swapper.swap_element_size)

    def _finish_write(self, writing: list[_Slice]) -> None:
        if not writing:
            return
        assert self._writer is not None and self._half_writer is not None
        # Both handles drained before any buffer is freed: a write still in flight must not read a freed one.
        errors = [self._drain(h) for h in (self._writer, self._half_writer)]
        for s in writing:
            self.swapper.swap_buffer_manager.free(s.buffers)
        writing.clear()
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _abandon(self, slices: list[_Slice | None]) -> None:
        """After an error: every handle drained (no I/O left into a buffer), every buffer freed."""
        for h in [*self._readers, self._writer, self._half_writer]:
            if h is not None:
                self._drain(h)
        for s in slices:
            if s is not None:
                self.swapper.swap_buffer_manager.free(s.buffers)

    @staticmethod
    def _drain(handle: ExtentSwapHandle) -> BaseException | None:
        """Wait every op of `handle` (it drains all before it raises); the error, if any, returned."""
        try:
            handle.wait()
        except BaseException as exc:
            return exc
        return None


def install_sliced_update(zero: ZeroOptimizer, swapper: MemstrataOptimizerSwapper, grads: DramGradients,
                          layer: SwapLayer, slice_elements: int) -> SlicedUpdate:
    """Wrap the step loop's per-sub-group methods so that each sliced sub-group runs `SlicedUpdate.update` in place
    of stock's swap-in, unscale, Adam, 16-bit copy and swap-out; every other sub-group, and every call outside
    `step()` (a checkpoint's load or save, DeepSpeed's `reset_swap_buffers`), is stock's."""
    sliced = SlicedUpdate(zero, swapper, grads, layer, slice_elements)
    if not sliced.ids:
        return sliced
    swapper.readahead.never_read |= sliced.param_ids()

    def hook(name: str, body: Callable[..., Any]) -> None:
        original = getattr(zero, name)

        @functools.wraps(original)
        def call(sub_group_id: int, *args: Any, **kwargs: Any) -> Any:
            # `swapper.stepping` (memstrata.runtime.swap.integration): only a step's loop is sliced. The loop calls
            # `_prepare_sub_group` first for every sub-group, so an `active` left by a failed step is replaced.
            if swapper.stepping and sub_group_id in sliced.ids and (name == "_prepare_sub_group"
                                                                    or sliced.active == sub_group_id):
                return body(sub_group_id, *args, **kwargs)
            return original(sub_group_id, *args, **kwargs)

        setattr(zero, name, call)

    def prepare(i: int, *_: Any) -> None:
        sliced.active = i  # nothing is swapped in: the slices are read by the update itself

    def release(i: int, *_: Any) -> None:
        sliced.active = None
        zero.fp32_partitioned_groups_flat[i].grad = None

    def reassign(i: int) -> None:
        if zero.fp16_partitioned_groups_flat[i] is not None:  # written slice by slice; re-point the parameter
            zero._unflatten_partitioned_parameters(i)

    hook("_prepare_sub_group", prepare)
    hook("unscale_and_clip_grads", sliced.update)
    hook("_optimizer_step", lambda i: None)
    hook("_reassign_or_swap_out_partitioned_parameters", reassign)
    hook("_release_sub_group", release)
    return sliced
