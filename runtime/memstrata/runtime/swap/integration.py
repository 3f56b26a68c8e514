"""The one place memstrata touches DeepSpeed: `initialize`, a drop-in for `deepspeed.initialize`.

DeepSpeed 0.19.8 only: any other version is refused with a clear message, and
before anything is built the installed DeepSpeed is checked against
memstrata.runtime.swap.seam, the declared list of every DeepSpeed internal the
hooks below rely on (names, signatures, the attributes memstrata's swappers
re-create, the step's sub-group loop); one error names every entry that no
longer matches. A new hook gets its entries there first.

Hook points:

1. `deepspeed.runtime.zero.partition_parameters.AsyncPartitionedParameterSwapper`
   - the class `zero.Init` instantiates for `offload_param.device: nvme`;
2. `deepspeed.runtime.zero.stage3.PartitionedOptimizerSwapper` and
   `...stage3.PipelinedOptimizerSwapper` - the classes ZeRO-3 instantiates for
   `offload_optimizer.device: nvme`.
   Both are rebound to memstrata's subclasses only for the duration of the
   `deepspeed.initialize` call (and restored after, even on error), so a plain
   `deepspeed.initialize` in the same process still gets stock DeepSpeed.
3. The ZeRO-3 optimizer *instance*'s `has_overflow` (fp16 only): one pass of
   memstrata.runtime.strata.overflow instead of `isinf().any()` + `isnan().any()`.
4. `_swappable_optimizer_subgroup` (on the class while ZeRO-3 is built, on the instance
   after): the sub-groups the plan keeps in DRAM are not swappable
   (memstrata.runtime.swap.resident).
5. The same instance's `step` and the per-sub-group methods its loop calls
   (memstrata.runtime.swap.suborder): the sub-group order reversed every step, the
   last K kept in DRAM.
6. The same instance's `_offload_grad_partition_at_boundary`
   (memstrata.runtime.swap.gradients): gradients stay in DRAM, 16-bit where that
   changes no value (`data_types.grad_accum_dtype` set when the user did not),
   and are widened to fp32 by the optimizer swapper in the update.
7. The same instance's `step`, once more (`SwapSettings.trim_after_step`): after it,
   locked regions nothing uses are given back, except the one region the
   update's buffers are carved from, locked once for the run.
8. The accelerator's `pin_memory`/`unpin_memory`, while the model and the engine
   are constructed (memstrata.runtime.swap.pinning): what ZeRO-3 pins comes from
   the layer's exact pools, never torch's power-of-two host allocator.
9. The loop's per-sub-group methods once more, before the order hook
   (memstrata.runtime.swap.sliced): a sub-group of one tensor larger than a slice
   is updated a slice at a time.
10. `initialize_optimizer_states` on the class while ZeRO-3 is built
   (memstrata.runtime.swap.resident): its construction walk is skipped where
   nothing reads what it makes; and `offload_optimizer.fast_init` is turned on
   where the weights are on NVMe, so the fp32 master is written a chunk at a time
   (memstrata.runtime.swap.optimizer).
11. `step` outermost, each trainable parameter's `all_gather`/`all_gather_coalesced`, the engine's `forward`,
   `backward`, checkpoint and save methods and the optimizer's `state_dict`/`load_state_dict`
   (memstrata.runtime.swap.overlap): the update runs beside the next forward, which waits per sub-group for the
   weights it gathers, and is joined when that forward ends and before anything else reads the optimizer.

Everything else - partitioning, the coordinator, the CPU Adam step - is stock.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstrata.runtime.swap.cpufacts import cpu_info_answered
from memstrata.runtime.swap.hostheap import bound_host_heap, release_free_heap, warn_without_huge_pages
from memstrata.runtime.swap.layer import SwapLayer, SwapSettings, activate, node_ranks
from memstrata.runtime.swap.stratamap import unplanned_namespace_bytes
from memstrata.runtime.swap.updatemode import install_update_beside
from memstrata.runtime.swap.protocols import Engine, ZeroOptimizer
from memstrata.runtime.swap.seam import SeamMismatch, UnsupportedDeepSpeed
from memstrata.runtime.swap.seamcheck import ensure_verified

if TYPE_CHECKING:
    import torch

__all__ = ["SUPPORTED_DEEPSPEED", "SeamMismatch", "UnsupportedDeepSpeed", "check_version", "constructing",
           "init_distributed", "initialize", "open_layer"]

SUPPORTED_DEEPSPEED = "0.19.8"


def check_version(version: str | None = None) -> str:
    """The installed DeepSpeed version, or UnsupportedDeepSpeed naming both versions."""
    if version is None:
        import deepspeed

        version = str(deepspeed.__version__)
    version = version.strip()
    if version.split("+")[0] != SUPPORTED_DEEPSPEED:
        raise UnsupportedDeepSpeed(
            f"memstrata's swap layer replaces DeepSpeed internals and supports DeepSpeed {SUPPORTED_DEEPSPEED} only; "
            f"found {version}. Install deepspeed=={SUPPORTED_DEEPSPEED} or set memory.engine: deepspeed")
    return version


@contextlib.contextmanager
def _swappers_installed() -> Iterator[None]:
    from deepspeed.runtime.zero import partition_parameters, stage3

    from memstrata.runtime.swap.optimizer import MemstrataOptimizerSwapper
    from memstrata.runtime.swap.parameters import MemstrataParamSwapper

    slots = [(partition_parameters, "AsyncPartitionedParameterSwapper", MemstrataParamSwapper),
             (stage3, "PartitionedOptimizerSwapper", MemstrataOptimizerSwapper),
             (stage3, "PipelinedOptimizerSwapper", MemstrataOptimizerSwapper)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in slots]
    try:
        for mod, name, cls in slots:
            setattr(mod, name, cls)
        yield
    finally:
        for mod, name, orig in saved:
            setattr(mod, name, orig)


def _one_pass_has_overflow(layer: SwapLayer) -> Callable[[ZeroOptimizer, bool], bool]:
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    from memstrata.runtime.strata.overflow import has_overflow as scan

    def has_overflow(self: ZeroOptimizer, partition_gradients: bool = True) -> bool:
        if not partition_gradients:
            return type(self).has_overflow(self, partition_gradients)
        layer.overflow_checks += 1
        # The scan reads the host gradient buffer; the flag goes where the process group reduces (NCCL reduces
        # only device tensors): the accelerator's device, as stock's flag does.
        flag = torch.tensor([1 if scan(self.grad_partitions_flat_buffer) else 0], dtype=torch.uint8,
                            device=get_accelerator().current_device_name())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=flag, op=dist.ReduceOp.MAX)
        return bool(flag[0].item())

    return has_overflow


def _trim_after_step(optimizer: ZeroOptimizer, layer: SwapLayer) -> None:
    step = optimizer.step

    def step_then_trim(*args: Any, **kwargs: Any) -> Any:
        # The activations freed by backward and the update's temporaries sit in malloc's free lists;
        # returning them between phases keeps one phase's garbage out of the next one's peak.
        release_free_heap()
        try:
            return step(*args, **kwargs)
        finally:
            layer.trim()

    optimizer.step = step_then_trim


def _unplanned_dir(settings: SwapSettings, config: dict[str, Any] | str | os.PathLike[str] | None,
                   swap_dir: Path | None) -> Path | None:
    """Where a layer creates its one file-backed namespace when its settings name none (a script of one's own, with
    no plan): `swap_dir`, else the DeepSpeed config's offload nvme_path, where `deepspeed.initialize` itself would
    have swapped (the drop-in's contract). A planned layer (the plan's namespaces, or `no_nvme`) needs no such
    directory and takes nothing from DeepSpeed's config."""
    if settings.nvme or settings.no_nvme:
        return None
    return swap_dir if swap_dir is not None else _nvme_path(config)


def _nvme_path(config: dict[str, Any] | str | os.PathLike[str] | None) -> Path:
    cfg = config if isinstance(config, dict) else {}
    if isinstance(config, (str, os.PathLike)):
        import json

        cfg = json.loads(Path(config).read_text())
    zero = cfg.get("zero_optimization", {})
    for key in ("offload_optimizer", "offload_param"):
        path = (zero.get(key) or {}).get("nvme_path")
        if path:
            return Path(path)
    raise ValueError("memstrata.runtime.initialize: the swap settings name no NVMe namespace and the DeepSpeed "
                     "config has no zero_optimization.offload_*.nvme_path for a file-backed one; name namespaces "
                     "(swap nvme) or set nvme_path")


def _settings(swap: SwapSettings | dict[str, Any] | None) -> SwapSettings:
    if swap is None:
        env = os.environ.get("MEMSTRATA_SWAP")
        return SwapSettings.model_validate_json(env) if env else SwapSettings()
    return swap if isinstance(swap, SwapSettings) else SwapSettings.model_validate(swap)


def _zero3(engine: Engine) -> ZeroOptimizer | None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    opt = engine.optimizer
    return opt if isinstance(opt, DeepSpeedZeroOptimizer_Stage3) else None


def init_distributed(backend: str) -> None:
    """deepspeed.init_distributed, quietly: on the CPU it prints 'DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op
    built successfully' to stdout on every run (deepspeed/comm/torch.py), where the run's own output goes. That
    line is dropped; anything else it prints goes to stderr, not lost."""
    import deepspeed

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    rest = [line for line in printed.getvalue().splitlines() if not line.endswith(" built successfully")]
    if rest:
        print("\n".join(rest), file=sys.stderr)


def open_layer(config: dict[str, Any] | str | os.PathLike[str] | None,
               swap: SwapSettings | dict[str, Any] | None = None, *, numel: int,
               swap_dir: Path | None = None) -> SwapLayer:
    """The swap layer for a model of `numel` parameters, opened before the model exists, so the model can be
    built straight into it (`constructing`) and then handed to `initialize(..., layer=...)`. `swap_dir`: where an
    unplanned layer makes its file-backed namespace (`_unplanned_dir`)."""
    check_version()
    ensure_verified()
    # The heap the runtime gives every run (memstrata.runtime.train.recipe), wherever the engine is opened (a
    # script calling memstrata.runtime.initialize, the offload benchmark): without it a run's host peak varies
    # with its threads' timing (gpt-350m at a 1.99 GiB budget: 3.3-3.9 GiB, OOM-killed under a 3.78 GiB cap in
    # half the runs the benchmark watched; with it 3.07-3.08 GiB in every run). Its page faults are taken back by
    # huge pages, where torch has not allocated yet (memstrata.runtime.swap.hostheap).
    bound_host_heap()
    huge_pages = warn_without_huge_pages()
    import deepspeed
    from deepspeed import comm as dist

    from deepspeed.accelerator import get_accelerator

    settings = _settings(swap)
    accelerator = get_accelerator()
    if not dist.is_initialized():
        # ZeRO-3's collectives run on the accelerator's backend: NCCL on a GPU (gloo cannot reduce CUDA tensors
        # at speed, and NCCL nothing else), gloo on the CPU.
        init_distributed(accelerator.communication_backend_name())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    layer = SwapLayer.open(settings, rank=dist.get_rank(), local_rank=local_rank,
                           local_world=node_ranks(settings, os.environ),
                           fallback_dir=_unplanned_dir(settings, config, swap_dir),
                           needed_bytes=unplanned_namespace_bytes(numel), device=accelerator.current_device_name())
    layer.huge_page_tensors = huge_pages
    return layer


@contextlib.contextmanager
def constructing(layer: SwapLayer) -> Iterator[SwapLayer]:
    """While a model is built under `deepspeed.zero.Init` (and its weights loaded), its partitions are swapped
    through `layer`, never through DeepSpeed's swap folder."""
    from memstrata.runtime.swap.pinning import pins_served
    from memstrata.runtime.swap.resident import deciding

    with activate(layer), _swappers_installed(), deciding(layer), pins_served(layer.pins):
        yield layer


def initialize(*args: Any, swap: SwapSettings | dict[str, Any] | None = None, layer: SwapLayer | None = None,
               **kwargs: Any) -> tuple[Any, ...]:
    """`deepspeed.initialize(...)` with memstrata's swap layer; same arguments, same 4-tuple.

    `swap` (or the MEMSTRATA_SWAP environment variable, JSON) configures the layer; `layer` is one
    `open_layer` already opened (the model was built into it), whose settings then apply. The returned
    engine carries the layer as `engine.memstrata`."""
    check_version()
    ensure_verified()
    import deepspeed

    settings = layer.settings if layer is not None else _settings(swap)
    # By name, as deepspeed.initialize reads them, whether the caller passed them by position or keyword.
    call = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    key = "config" if call.arguments.get("config") is not None else "config_params"
    config = call.arguments.get(key)
    if config is not None:
        from memstrata.runtime.swap.gradients import accumulation_config
        from memstrata.runtime.swap.optimizer import fast_init_config

        call.arguments[key] = config = fast_init_config(config)
        if settings.dram_gradients:
            call.arguments[key] = config = accumulation_config(config)
    if layer is None:
        model = call.arguments.get("model")
        numel = sum(p.numel() for p in model.parameters()) if model is not None else 0
        layer = open_layer(config, settings, numel=numel)
    try:
        with constructing(layer), cpu_info_answered():
            result = deepspeed.initialize(*call.args, **call.kwargs)
    except BaseException:
        layer.close()
        raise
    engine: Engine = result[0]
    engine.memstrata = layer  # for a caller that holds only the engine
    opt = _zero3(engine)
    if opt is not None:
        _install_step_hooks(opt, layer)
        if layer.overlap is not None:
            layer.overlap.wrap_engine(engine)
        if settings.one_pass_overflow and engine.fp16_enabled():
            opt.has_overflow = types.MethodType(_one_pass_has_overflow(layer), opt)
    return result


def _install_step_hooks(opt: ZeroOptimizer, layer: SwapLayer) -> None:
    """The hooks on a built ZeRO-3 optimizer's instance, in the order each must wrap the ones before it."""
    from memstrata.runtime.swap.optimizer import MemstrataOptimizerSwapper

    settings, swapper = layer.settings, opt.optimizer_swapper
    if isinstance(swapper, MemstrataOptimizerSwapper):
        from memstrata.runtime.swap.resident import keep_resident_decision

        keep_resident_decision(opt, layer)
        _mark_steps(opt, swapper)
        # Gradients first: the order hook wraps whatever per-sub-group methods it finds and calls them with real
        # ids; the sliced update next, so that the order hook calls it too.
        if settings.dram_gradients:
            from memstrata.runtime.swap.gradients import install_dram_gradients

            layer.dram_gradients = swapper.use_dram_gradients(install_dram_gradients(opt, layer))
        if settings.slice_subgroups and layer.dram_gradients is not None:
            from memstrata.plan.accounting import slice_elements
            from memstrata.runtime.swap.sliced import install_sliced_update

            layer.sliced = install_sliced_update(opt, swapper, layer.dram_gradients, layer,
                                                 settings.slice_elements or slice_elements(int(opt.sub_group_size)))
        overlap = install_update_beside(opt, layer)
        # The order hook also drives the pipelined update's read-ahead, so it is there whenever either is on.
        if settings.cache_subgroups > 0 or settings.prefetch_subgroups > 0 or overlap is not None:
            from memstrata.runtime.swap.suborder import install_reversing_order

            layer.subgroup_order = install_reversing_order(opt, swapper, settings.cache_subgroups,
                                                           overlap.order if overlap is not None else None)
        if layer.dram_gradients is not None:
            layer.pool.reserve(_update_buffer_bytes(opt, layer))
    if settings.trim_after_step:
        _trim_after_step(opt, layer)
    if layer.overlap is not None:  # outermost: the whole step, trimming included, runs on the update thread
        layer.overlap.wrap_step()
        layer.overlap.wrap_params()


def _mark_steps(opt: ZeroOptimizer, swapper: Any) -> None:
    """`swapper.stepping` is true exactly while `opt.step()` runs: a swap-in there is an update's, not a
    checkpoint's."""
    step = opt.step

    @functools.wraps(step)
    def marked(*args: Any, **kwargs: Any) -> Any:
        swapper.stepping = True
        try:
            return step(*args, **kwargs)
        finally:
            swapper.stepping = False

    opt.step = marked


def _update_buffer_bytes(opt: ZeroOptimizer, layer: SwapLayer) -> int:
    """What the update's buffers take at once, by the planner's rule (memstrata.plan.buffers.update_buffer_bytes)
    applied to this optimizer's real sub-groups: the optimizer pool locks that once, for the run."""
    from memstrata.plan.buffers import subgroups_update_bytes
    from memstrata.runtime.swap.resident import resident_ids

    sizes = [int(n) for n in opt.fp16_partitioned_groups_flat_numel]
    sliced = layer.sliced
    ids, piece = (sliced.ids, sliced.slice) if sliced is not None else (set[int](), 0)
    streamed = {i for i in range(len(sizes)) if opt._swappable_optimizer_subgroup(i)}
    return subgroups_update_bytes(sizes, sliced=ids, streamed=streamed, resident=resident_ids(opt), piece=piece,
                                  read_ahead=layer.settings.prefetch_subgroups,
                                  cached=layer.settings.cache_subgroups)
