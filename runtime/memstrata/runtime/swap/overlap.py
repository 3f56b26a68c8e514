"""The optimizer update overlapped with the next forward, with ZeRO-3's numerics unchanged (GreedySnake's overlap).

The next step's forward of a layer needs only that layer's updated 16-bit weights. So `step()` runs on an update
thread: the main thread waits only for the part before the sub-group loop (the overflow check and the gradient
norm, whose collectives must stay in the main thread's order), then returns, and the training loop goes on to its
scheduler step, logging and the next forward while the loop reads, updates and writes back sub-groups in the order
the forward uses them (`forward_order`). Each parameter's gather (`all_gather` and `all_gather_coalesced`, which
every path to a parameter's value goes through: the forward's fetch, `GatheredParameters`, a model save) first
waits for its sub-group's 16-bit copy; the optimizer state's write-back goes on behind it. The update is joined
when that forward ends, so backward (which writes the gradient buffers the update reads) never runs beside it,
and before anything else that reads the optimizer's state: a checkpoint's save or load (DeepSpeed's, and
memstrata's, which reads sub-groups itself and so `settle`s first), the optimizer's `state_dict`, the engine's
`destroy`, the layer's `close`, and the next `step()`.

What the update reads of what the main thread may change meanwhile is frozen as of the `step()` call: the
optimizer's hyperparameters (an LR scheduler steps right after `step()` returns) are read by the update thread
from a snapshot (`StepGroup`); the loss scale and the clip norm are fixed before the loop, and nothing else
changes them until the next `step()`, which joins first. Losses are bit for bit the serial update's.

It is refused, and the update runs in place as before (the reason in the layer's status), where the forward
could read something the update writes without gathering it, or the loop is not the per-sub-group CPU loop:
weights on NVMe (the forward's reads and the update's writes would share the rank's single-threaded NVMe
engine and staging pool), persistent parameters (the forward reads them without a gather), ZeRO++'s secondary
partitions, Muon, ZenFlow and torch-autocast's GradScaler.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memstrata.runtime.swap.protocols import Engine, ZeroOptimizer
from memstrata.runtime.swap.status import OverlapStatus

__all__ = ["OverlappedUpdate", "StepGroup", "forward_order", "refusal", "settle"]

_LOCAL = threading.local()  # .frozen: {id(param group): its hyperparameters as of the step}, on the update thread


class StepGroup(dict[str, Any]):
    """An optimizer param group whose hyperparameters, read on the update thread, are the ones of the step it runs:
    a scheduler may set the next step's learning rate meanwhile, and every other reader sees that one."""

    def __getitem__(self, key: Any) -> Any:
        frozen = getattr(_LOCAL, "frozen", None)
        if frozen is not None and key != "params":
            values = frozen.get(id(self))
            if values is not None and key in values:
                return values[key]
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


def freeze_groups(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Every param group of `optimizer` made a StepGroup (in place: a scheduler holds the list, not the dicts; a
    checkpoint load replaces them, so this runs each step) and its hyperparameters now."""
    groups = optimizer.param_groups
    for i, group in enumerate(groups):
        if not isinstance(group, StepGroup):
            groups[i] = StepGroup(group)
    return {id(g): {k: v for k, v in dict.items(g) if k != "params"} for g in groups}


def refusal(opt: ZeroOptimizer) -> str | None:
    """Why this optimizer's update cannot run beside the forward (see the module), or None."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    # Every parameter, frozen ones too (LoRA's base weights): the forward reads them all.
    params = [p for p in opt.module.parameters() if getattr(p, "ds_tensor", None) is not None]
    if any(getattr(p.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme for p in params):
        return "weights on NVMe: the forward's reads and the update's writes share the rank's NVMe engine"
    reasons = ((len(opt.persistent_parameters) > 0, "persistent parameters (stage3_param_persistence_threshold > 0): "
                "the forward reads them without a gather"),
               (opt.zero_hpz_partition_size > 1, "ZeRO++ secondary partitions (zero_hpz_partition_size > 1)"),
               (bool(opt.use_muon), "Muon"), (bool(getattr(opt, "zenflow", False)), "ZenFlow"),
               (opt.torch_autocast_gradscaler is not None, "torch autocast's GradScaler steps inside the loop"))
    return next((why for refused, why in reasons if refused), None)


def forward_order(opt: ZeroOptimizer) -> list[int]:
    """Sub-group ids in the order the forward first uses them: by their earliest parameter in the module's
    parameter order (ZeRO-3 lists a second param group's sub-groups, the no-decay biases and norms of every
    layer, after the first's)."""
    position = {id(p): i for i, p in enumerate(opt.module.parameters())}
    last = len(position)

    def first_use(g: int) -> int:
        return min((position.get(id(p), last) for p in opt.fp16_groups[g]), default=last)

    return sorted(range(len(opt.fp16_groups)), key=lambda g: (first_use(g), g))


class _Update:
    """One step's update on its thread: a done event per sub-group (its 16-bit copy is final), whether the loop
    began (or the step ended without one), the error it raised."""

    def __init__(self, groups: int) -> None:
        self.done = [threading.Event() for _ in range(groups)]
        self.looping = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.ident: int | None = None
        self.thread: threading.Thread | None = None
        self.seconds = 0.0


def settle(opt: Any) -> None:
    """Wait for the update `opt` may be running beside the forward (raising its error): before reading any of its
    state directly, as memstrata's checkpoint does (a resident sub-group is read without a swap call, and the
    sliced update points its master at one slice at a time)."""
    overlap = getattr(opt, "memstrata_overlap", None)
    if overlap is not None:
        overlap.join()


def bind_thread(accelerator: Any, device: torch.device) -> None:
    """The update thread's accelerator device: CUDA's current device is per thread and starts at 0, so on any rank
    but a node's first the update would allocate and copy on another rank's GPU."""
    if device.type != "cpu" and device.index is not None:
        accelerator.set_device(device.index)


def fence(accelerator: Any, tensor: torch.Tensor | None) -> None:
    """A 16-bit partition on the accelerator was written by this thread's stream: wait for it before the forward,
    on its own streams, may read it."""
    if tensor is not None and tensor.device.type != "cpu":
        accelerator.current_stream().synchronize()


def _gather_list(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The parameters `param.all_gather(param_list=None, ...)` gathers; None: the parameter itself."""
    return args[0] if args else kwargs.get("param_list")


def _coalesced_list(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The parameters `param.all_gather_coalesced(params, ...)` gathers."""
    return args[0] if args else kwargs["params"]


class OverlappedUpdate:
    """The hooks of one ZeRO-3 optimizer's overlapped update (see the module)."""

    def __init__(self, opt: ZeroOptimizer, accelerator: Any = None) -> None:
        from deepspeed.accelerator import get_accelerator

        self.opt = opt
        opt.memstrata_overlap = self  # for `settle`: whoever holds the optimizer can wait for its update
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        self.subgroup_of = {id(p): g for g, group in enumerate(opt.fp16_groups) for p in group}
        self.order = forward_order(opt)
        self.current: _Update | None = None
        self.updates = self.forward_waits = 0
        self.update_seconds = self.forward_wait_seconds = self.join_wait_seconds = 0.0

    def report(self) -> OverlapStatus:
        return OverlapStatus(on=True, updates=self.updates, update_seconds=round(self.update_seconds, 3),
                             forward_waits=self.forward_waits,
                             forward_wait_seconds=round(self.forward_wait_seconds, 3),
                             join_wait_seconds=round(self.join_wait_seconds, 3))

    # -- the update thread ------------------------------------------------------------------------------
    def _mine(self) -> _Update | None:
        u = self.current
        return u if u is not None and u.ident == threading.get_ident() else None

    def wrap_loop(self) -> None:
        """Wrap the loop's first and its 16-bit call; installed where they see real sub-group ids (under the order
        hook)."""
        opt = self.opt
        prepare, reassign = opt._prepare_sub_group, opt._reassign_or_swap_out_partitioned_parameters

        @functools.wraps(prepare)
        def prepare_then_signal(sub_group_id: int, *args: Any, **kwargs: Any) -> Any:
            u = self._mine()
            if u is not None:
                u.looping.set()  # the collectives before the loop are done: the caller may go on
            return prepare(sub_group_id, *args, **kwargs)

        @functools.wraps(reassign)
        def reassign_then_signal(sub_group_id: int) -> Any:
            out = reassign(sub_group_id)
            u = self._mine()
            if u is not None:
                fence(self.accelerator, opt.fp16_partitioned_groups_flat[sub_group_id])
                u.done[sub_group_id].set()
            return out

        opt._prepare_sub_group = prepare_then_signal
        opt._reassign_or_swap_out_partitioned_parameters = reassign_then_signal

    def wrap_step(self) -> None:
        """`opt.step` (outermost of its wrappers) runs on an update thread; it returns once the loop has begun."""
        inner = self.opt.step

        @functools.wraps(inner)
        def step(*args: Any, **kwargs: Any) -> None:
            self.join()
            u = _Update(len(self.opt.fp16_groups))
            frozen = freeze_groups(self.opt.optimizer)
            grad_mode = torch.is_grad_enabled()
            device = torch.device(self.accelerator.current_device_name())

            def run() -> None:
                u.ident = threading.get_ident()
                _LOCAL.frozen = frozen
                t0 = time.monotonic()
                try:
                    bind_thread(self.accelerator, device)
                    with torch.set_grad_enabled(grad_mode):
                        inner(*args, **kwargs)
                except BaseException as exc:  # handed to the main thread by the next wait or join
                    u.error = exc
                finally:
                    _LOCAL.frozen = None
                    u.seconds = time.monotonic() - t0
                    for event in (*u.done, u.looping, u.finished):
                        event.set()

            self.current = u
            u.thread = threading.Thread(target=run, name="memstrata-update", daemon=True)
            u.thread.start()
            u.looping.wait()
            if u.finished.is_set():  # skipped on overflow, or failed before its loop: as the serial step would
                self.join()

        self.opt.step = step

    # -- the main thread --------------------------------------------------------------------------------
    def wait_for(self, params: Iterable[Any]) -> None:
        """Until every sub-group holding one of `params` has its 16-bit copy (raising what the update raised)."""
        waited = self.wait_done(params)
        if waited is not None:
            self.forward_wait_seconds += waited
            self.forward_waits += 1
        u = self.current
        if u is not None and u.error is not None and u.ident != threading.get_ident():
            self.join()

    def wait_done(self, params: Iterable[Any]) -> float | None:
        """Until the update in flight (if any, and not this thread's) has signalled `done` for every sub-group
        holding one of `params`: the seconds waited, or None where nothing was pending."""
        u = self.current
        if u is None or u.ident == threading.get_ident():
            return None
        groups = {self.subgroup_of.get(id(p), -1) for p in params} - {-1}  # -1: frozen, never updated
        pending = [u.done[g] for g in groups if not u.done[g].is_set()]
        if not pending:
            return None
        t0 = time.monotonic()
        for event in pending:
            event.wait()
        return time.monotonic() - t0

    def join(self) -> None:
        """Until the update in flight has finished; its error raised here (once)."""
        u = self.current
        if u is None or u.ident == threading.get_ident():
            return
        t0 = time.monotonic()
        assert u.thread is not None
        u.thread.join()
        self.join_wait_seconds += time.monotonic() - t0
        self.current = None
        self.updates += 1
        self.update_seconds += u.seconds
        if u.error is not None:
            u.error.add_note("raised by the optimizer update that ran beside the forward (memstrata.runtime.swap."
                             "overlap)")
            raise u.error

    def wrap_params(self) -> None:
        """Every trainable parameter's gathers wait for its sub-group first."""
        for group in self.opt.fp16_groups:
            for p in group:
                p.all_gather = self._waiting(p.all_gather, _gather_list, p)
                p.all_gather_coalesced = self._waiting(p.all_gather_coalesced, _coalesced_list, p)

    def _waiting(self, gather: Callable[..., Any], named: Callable[[tuple[Any, ...], dict[str, Any]], Any],
                 param: Any) -> Callable[..., Any]:
        @functools.wraps(gather)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.current is not None:
                self.before_gather(named(args, kwargs) or [param])
            return gather(*args, **kwargs)

        return call

    def before_gather(self, params: Iterable[Any]) -> None:
        """What a gather of `params` does first while an update runs: here, wait for their sub-groups."""
        self.wait_for(params)

    def wrap_engine(self, engine: Engine) -> None:
        """Join when the forward ends and before whatever else reads the optimizer's state."""
        forward = engine.forward

        @functools.wraps(forward)
        def forward_then_join(*args: Any, **kwargs: Any) -> Any:
            try:
                out = forward(*args, **kwargs)
            except BaseException:
                self.join_quietly()
                raise
            self.join()
            return out

        engine.forward = forward_then_join
        engine.backward = self._joining(engine.backward)
        self.join_before_readers(engine)

    def join_before_readers(self, engine: Engine) -> None:
        """Join before whatever reads the optimizer's state or saves the weights: a checkpoint's save or load, a
        16-bit save, `destroy`, the optimizer's `state_dict` and `load_state_dict`."""
        for owner, names in ((engine, ("save_checkpoint", "load_checkpoint", "save_16bit_model", "destroy")),
                             (self.opt, ("state_dict", "load_state_dict"))):
            for name in names:
                setattr(owner, name, self._joining(getattr(owner, name)))

    def _joining(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.join()
            return method(*args, **kwargs)

        return call

    def join_quietly(self) -> None:
        """Join, the update's error dropped: a failure already on its way up is the one to report."""
        try:
            self.join()
        except BaseException:
            pass
