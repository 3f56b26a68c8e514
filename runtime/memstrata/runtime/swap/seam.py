"""Every DeepSpeed internal memstrata relies on, declared once and checked against the installed DeepSpeed.

memstrata's swap layer supports exactly one DeepSpeed release (integration.SUPPORTED_DEEPSPEED), because
it rebinds module attributes, replaces methods on the ZeRO-3 optimizer instance, subclasses DeepSpeed's
swappers without running their constructors and reads private attributes. `SEAM` lists each of those
names with why memstrata needs it; `verify()` checks them all and raises one `SeamMismatch` listing every
entry that no longer matches, so a DeepSpeed upgrade is reviewed against a list, not found by a
crash inside a training step. memstrata.runtime.swap.protocols gives the same objects their types.

One transformers internal is declared the same way (the layers' checkpoint function, below).
A new dependency on DeepSpeed gets an entry here (tests/offload/test_seam.py scans the runtime's source
and fails on an undeclared one).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

# Checked against the installed DeepSpeed by memstrata.runtime.swap.seamcheck (verify, ensure_verified).
__all__ = ["Dependency", "Kind", "Mismatch", "SEAM", "STEP_LOOP", "SeamMismatch", "UnsupportedDeepSpeed"]


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed is not the one memstrata's swap layer was written against."""


class Kind(enum.Enum):
    REBOUND = "rebound"  # a module attribute memstrata rebinds while deepspeed.initialize runs
    IMPORTED = "imported"  # a module attribute or class member memstrata imports or reads
    WRAPPED = "wrapped"  # a method memstrata wraps or replaces on the ZeRO-3 optimizer instance
    OVERRIDDEN = "overridden"  # a method a memstrata class overrides or stands in for; DeepSpeed calls it
    CALLED = "called"  # a function or method memstrata calls; its leading parameters are checked
    ATTRIBUTE = "attribute"  # an attribute a stock method assigns and memstrata reads or writes
    RECREATED = "recreated"  # assigned by a stock method memstrata's subclass skips; the subclass sets it
    SKIPPED = "skipped"  # assigned by that skipped method, deliberately not set by the subclass


@dataclass(frozen=True)
class Dependency:
    kind: Kind
    owner: str  # dotted path of the module or class that holds `name`
    name: str
    why: str
    # Parameter names after `self`, in order ("*args", "**kwargs" for variadics). WRAPPED and OVERRIDDEN:
    # the whole signature, since DeepSpeed calls memstrata's version as it calls its own. CALLED: the leading
    # ones memstrata passes; any later parameter must have a default.
    params: tuple[str, ...] | None = None
    set_in: str | None = None  # ATTRIBUTE/RECREATED/SKIPPED: the stock method whose body assigns it
    on: str = "self"  # the object that method assigns `name` on, as written in its source
    same_as: str | None = None  # REBOUND: the class memstrata subclasses, which the slot must still hold
    loop: tuple[str, ...] | None = None  # WRAPPED step: the self.<method> calls of its sub-group loop, in order

    @property
    def path(self) -> str:
        return f"{self.owner}.{self.name}"


@dataclass(frozen=True)
class Mismatch:
    subject: str  # the DeepSpeed object, dotted
    problem: str
    entry: Dependency | None = None  # None: something DeepSpeed added that no entry accounts for

    def line(self) -> str:
        kind = f" [{self.entry.kind.value}]" if self.entry is not None else ""
        why = f" (memstrata: {self.entry.why})" if self.entry is not None else ""
        return f"{self.subject}{kind}: {self.problem}{why}"


class SeamMismatch(UnsupportedDeepSpeed):
    def __init__(self, version: str, mismatches: list[Mismatch]) -> None:
        self.mismatches = tuple(mismatches)
        lines = "\n".join(f"  - {m.line()}" for m in self.mismatches)
        super().__init__(
            f"memstrata's swap layer relies on DeepSpeed internals that the installed DeepSpeed {version} no longer "
            f"provides as declared in memstrata.runtime.swap.seam ({len(self.mismatches)}):\n{lines}\n"
            "Update the seam and the code behind each entry, or set memory.engine: deepspeed.")


# The ZeRO-3 step's sub-group loop, whose per-sub-group calls memstrata.runtime.swap.suborder re-maps.
STEP_LOOP = ("_prepare_sub_group", "_muon_update_lacks_loss_scale", "unscale_and_clip_grads", "_optimizer_step",
             "_reassign_or_swap_out_partitioned_parameters", "_release_sub_group")

_ZERO = "deepspeed.runtime.zero"
_STAGE3 = f"{_ZERO}.stage3"
_Z3 = f"{_STAGE3}.DeepSpeedZeroOptimizer_Stage3"
_ST = "deepspeed.runtime.swap_tensor"
_OPT_SWAPPER = f"{_ST}.partitioned_optimizer_swapper.PartitionedOptimizerSwapper"
_BASE_SWAPPER = f"{_ST}.optimizer_utils.OptimizerSwapper"
_SWAP_INFO = f"{_ST}.optimizer_utils.OptimizerStateSwapInfo"
_PARAM_SWAPPER = f"{_ST}.partitioned_param_swapper.AsyncPartitionedParameterSwapper"
_BUFFERS = f"{_ST}.utils.SwapBufferManager"
_INIT = f"{_ZERO}.partition_parameters.Init"
_ACCEL = "deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator"
_SUBGROUP = ("sub_group_id",)


def _recreated(owner: str, set_in: str, names: dict[str, str]) -> list[Dependency]:
    return [Dependency(Kind.RECREATED, owner, n, why, set_in=set_in) for n, why in names.items()]


SEAM: tuple[Dependency, ...] = (
    # -- deepspeed.initialize and the version gate (integration) --
    Dependency(Kind.IMPORTED, "deepspeed", "__version__", "the version gate in front of this seam"),
    Dependency(Kind.CALLED, "deepspeed", "initialize", "wrapped by memstrata.runtime.initialize, which finds `model` "
               "and `config`/`config_params` among the caller's arguments by these names",
               params=("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                       "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                       "config_params")),
    Dependency(Kind.CALLED, "deepspeed", "init_distributed", "a process group before the swap layer opens "
               "(called with dist_backend=, verbose=)",
               params=("dist_backend", "auto_mpi_discovery", "distributed_port", "verbose")),
    Dependency(Kind.IMPORTED, "deepspeed", "comm", "ranks and the overflow flag's all-reduce"),
    Dependency(Kind.CALLED, "deepspeed.comm", "get_rank", "per-rank namespaces and swap names", params=()),
    Dependency(Kind.CALLED, "deepspeed.comm", "is_initialized", "initialize makes a gloo group if none", params=()),
    Dependency(Kind.CALLED, "deepspeed.comm", "all_reduce", "the one-pass overflow flag, max over ranks (op=, group=)",
               params=("tensor", "op", "group")),
    Dependency(Kind.IMPORTED, "deepspeed.comm", "ReduceOp", "ReduceOp.MAX for the overflow flag"),
    Dependency(Kind.IMPORTED, "deepspeed", "zero", "the public ZeRO-3 API the model loader and exporter use"),
    # -- the accelerator: where collectives reduce, and what ZeRO-3 pins (integration, pinning) --
    Dependency(Kind.IMPORTED, "deepspeed.accelerator", "get_accelerator", "the accelerator ZeRO-3 runs on"),
    Dependency(Kind.CALLED, _ACCEL, "current_device_name", "the device the overflow flag is reduced on and the "
               "swap layer's DMA device", params=()),
    Dependency(Kind.CALLED, _ACCEL, "communication_backend_name", "the backend of a process group the swap layer "
               "starts (NCCL on a GPU)", params=()),
    Dependency(Kind.WRAPPED, _ACCEL, "pin_memory", "replaced on the accelerator instance while the model and engine "
               "are built: exact buffers from the swap layer's pools", params=("tensor", "make_copy", "match_shape")),
    Dependency(Kind.WRAPPED, _ACCEL, "unpin_memory", "gives a served buffer back to its pool", params=("tensor",)),
    *[Dependency(Kind.IMPORTED, owner, name, "a pin asked for by it is 16-bit weights (placed where the plan put "
                 "the weights); any other pin is an operand of the CPU optimizer")
      for owner, name in ((_INIT, "_partition_param"), (_INIT, "_partition_param_sec"),
                          (_Z3, "_create_param_groups_fp16_flat_cpu_memory"))],
    Dependency(Kind.CALLED, "deepspeed.zero", "GatheredParameters", "one module's partitions gathered to load "
               "checkpoint tensors into them (modifier_rank=0) or to save them (modifier_rank=None)",
               params=("params", "modifier_rank")),
    # -- the classes ZeRO-3 instantiates, rebound to memstrata's subclasses (integration._swappers_installed) --
    Dependency(Kind.REBOUND, f"{_ZERO}.partition_parameters", "AsyncPartitionedParameterSwapper",
               "zero.Init instantiates it for offload_param nvme; memstrata's subclass goes in its place",
               same_as=_PARAM_SWAPPER),
    Dependency(Kind.REBOUND, _STAGE3, "PartitionedOptimizerSwapper",
               "ZeRO-3 instantiates it for offload_optimizer nvme; memstrata's subclass goes in its place",
               same_as=_OPT_SWAPPER),
    Dependency(Kind.REBOUND, _STAGE3, "PipelinedOptimizerSwapper",
               "ZeRO-3 instantiates it when offload_optimizer.pipeline is set; replaced by the same subclass",
               same_as=f"{_ST}.pipelined_optimizer_swapper.PipelinedOptimizerSwapper"),
    Dependency(Kind.OVERRIDDEN, _PARAM_SWAPPER, "swappable_tensor", "asked once per partition whether it goes to "
               "NVMe: the plan's DRAM share of the weights stays resident", params=("param", "numel")),
    Dependency(Kind.CALLED, _PARAM_SWAPPER, "__init__", "zero.Init constructs the rebound class positionally",
               params=("ds_config", "model_dtype")),
    Dependency(Kind.OVERRIDDEN, _OPT_SWAPPER, "__init__", "ZeRO-3 constructs the rebound class by these keywords",
               params=("swap_config", "aio_config", "base_folder", "optimizer", "largest_numel", "device", "dtype",
                       "timers")),
    # -- the ZeRO-3 optimizer instance (integration, suborder, gradients) --
    Dependency(Kind.IMPORTED, _STAGE3, "DeepSpeedZeroOptimizer_Stage3",
               "how initialize recognises the optimizer every hook below is installed on"),
    Dependency(Kind.ATTRIBUTE, "deepspeed.runtime.engine.DeepSpeedEngine", "optimizer",
               "where initialize finds the ZeRO-3 optimizer", set_in="__init__"),
    Dependency(Kind.CALLED, "deepspeed.runtime.engine.DeepSpeedEngine", "fp16_enabled",
               "the one-pass overflow check is for fp16 only", params=()),
    Dependency(Kind.WRAPPED, _Z3, "has_overflow", "replaced by the one-pass inf/nan scan (fp16)",
               params=("partition_gradients",)),
    Dependency(Kind.CALLED, _Z3, "_model_parallel_all_reduce", "the one-pass overflow flag over model-parallel ranks",
               params=("tensor", "op")),
    Dependency(Kind.ATTRIBUTE, _Z3, "grad_partitions_flat_buffer", "the DRAM gradients: overflow scan, status, "
               "widening", set_in="_setup_for_real_optimizer"),
    Dependency(Kind.ATTRIBUTE, _Z3, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
               "ds_id -> view of the flat gradient buffer, what DRAM gradients widen from",
               set_in="_setup_for_real_optimizer"),
    Dependency(Kind.ATTRIBUTE, _Z3, "dp_process_group", "the overflow flag's all-reduce group", set_in="__init__"),
    Dependency(Kind.ATTRIBUTE, _Z3, "optimizer_swapper", "the swapper the sub-group and gradient hooks talk to",
               set_in="_configure_tensor_swapping"),
    Dependency(Kind.ATTRIBUTE, _Z3, "fp16_groups", "the sub-groups: their count and their parameters",
               set_in="__init__"),
    Dependency(Kind.ATTRIBUTE, _Z3, "fp32_partitioned_groups_flat", "the fp32 sub-group tensor the swapper is handed",
               set_in="__init__"),
    Dependency(Kind.ATTRIBUTE, _Z3, "grad_position", "param id -> (sub-group, offset, numel) in the fp32 gradient",
               set_in="__init__"),
    Dependency(Kind.ATTRIBUTE, _Z3, "norm_for_param_grads", "the gradient norms the DRAM-gradient hook records",
               set_in="__init__"),
    Dependency(Kind.WRAPPED, _Z3, "step", "sub-group order per step, then trimming the locked pool",
               params=("closure",), loop=STEP_LOOP),
    Dependency(Kind.WRAPPED, _Z3, "_prepare_sub_group", "the loop's first call: where a reordered walk starts",
               params=("sub_group_id", "timer_names")),
    Dependency(Kind.WRAPPED, _Z3, "_muon_update_lacks_loss_scale", "re-mapped to the reordered sub-group",
               params=_SUBGROUP),
    Dependency(Kind.WRAPPED, _Z3, "unscale_and_clip_grads", "re-mapped to the reordered sub-group",
               params=("sub_group_id", "total_norm")),
    Dependency(Kind.WRAPPED, _Z3, "_optimizer_step", "re-mapped to the reordered sub-group", params=_SUBGROUP),
    Dependency(Kind.WRAPPED, _Z3, "_reassign_or_swap_out_partitioned_parameters",
               "re-mapped to the reordered sub-group", params=_SUBGROUP),
    Dependency(Kind.WRAPPED, _Z3, "_release_sub_group", "re-mapped to the reordered sub-group",
               params=("sub_group_id", "timer_names")),
    Dependency(Kind.WRAPPED, _Z3, "_offload_grad_partition_at_boundary", "replaced: gradients of NVMe sub-groups stay "
               "in DRAM", params=("param", "grad_buffer", "offload_fp32_gradients", "offload_fp32_offsets")),
    Dependency(Kind.WRAPPED, _Z3, "_swappable_optimizer_subgroup", "which sub-groups live on NVMe: the plan's "
               "resident ones never do (rebound on the class while ZeRO-3 is built)", params=_SUBGROUP),
    Dependency(Kind.WRAPPED, _Z3, "_get_fp32_grad_state_partition", "a resident sub-group's gradient outside the "
               "update, served from the 16-bit flat buffer", params=("param", "release_swap_buffers")),
    *[Dependency(Kind.WRAPPED, _Z3, n, "a gradient set on a resident sub-group is stored in the 16-bit flat "
                 "buffer", params=("value", "param")) for n in ("set_fp32_grad_for_param", "set_local_grad_for_param")],
    Dependency(Kind.WRAPPED, _Z3, "_create_fp16_sub_groups", "replaced while ZeRO-3 is built: a big tensor forms a "
               "sub-group of its own (memstrata.plan.accounting.group_tensors)", params=("params_group",)),
    Dependency(Kind.ATTRIBUTE, _Z3, "sub_group_size", "the unit memstrata's sub-group rule cuts by",
               set_in="__init__"),
    Dependency(Kind.ATTRIBUTE, _Z3, "fp16_partitioned_groups_flat_numel", "each sub-group's size, which the resident "
               "budget is spent on", set_in="__init__"),
    Dependency(Kind.CALLED, f"{_ZERO}.utils", "get_norm_dtype", "the dtype stock sums gradient norms in, which "
               "memstrata's boundary norm (memstrata.runtime.swap.gradients.partition_norm) sums in too", params=()),
    Dependency(Kind.CALLED, _Z3, "get_param_id", "keys of grad_position and of the swapper's state",
               params=("param",)),
    Dependency(Kind.WRAPPED, _Z3, "initialize_optimizer_states", "replaced while ZeRO-3 is built: its walk over "
               "the sub-groups is skipped where nothing reads what it makes (memstrata.runtime.swap.resident)",
               params=()),
    *[Dependency(Kind.ATTRIBUTE, _Z3, n, "whether the construction walk can be skipped", set_in="__init__")
      for n in ("offload_optimizer", "use_muon", "offload_optimizer_pin_memory", "device")],
    *[Dependency(Kind.ATTRIBUTE, _Z3, n, "a sub-group is sliced only without them (they step per call)",
                 set_in="__init__") for n in ("torch_autocast_gradscaler",)],
    Dependency(Kind.ATTRIBUTE, _Z3, "subgroup_to_device", "where a small sub-group's gradient buffer goes",
               set_in="_create_fp32_partitions"),
    # -- a sub-group updated a slice at a time (sliced) --
    *[Dependency(Kind.ATTRIBUTE, _Z3, n, "the sliced update casts each slice into the 16-bit partition it finds here",
                 set_in="__init__") for n in ("fp16_partitioned_groups_flat", "fp16_partitioned_groups")],
    Dependency(Kind.CALLED, _Z3, "_unflatten_partitioned_parameters", "after the slices, the 16-bit parameters are "
               "re-pointed into the flat buffer as stock's reassign does", params=_SUBGROUP),
    Dependency(Kind.ATTRIBUTE, "deepspeed.ops.adam.DeepSpeedCPUAdam", "fp32_optimizer_states", "slices assume fp32 "
               "moments, as its first step creates them", set_in="__init__"),
    Dependency(Kind.CALLED, _SWAP_INFO, "add_state_tensors", "the moments' records, made before the first update "
               "writes them a slice at a time", params=("tensor_list",)),
    Dependency(Kind.IMPORTED, f"{_ST}.partitioned_param_swapper.PartitionedParamStatus", "AVAILABLE",
               "a 16-bit partition in DRAM takes each slice in place"),
    Dependency(Kind.ATTRIBUTE, _INIT, "nvme_swapper", "the parameter swapper whose extent a slice's 16-bit cast is "
               "written to", set_in="_convert_to_deepspeed_param", on="param"),
    Dependency(Kind.CALLED, _PARAM_SWAPPER, "_io_aligned_numel", "the stored size of a 16-bit partition",
               params=("numel",)),
    # -- checkpoints (train.checkpoints.checkpoint): sub-groups brought in and put back as a step does --
    Dependency(Kind.CALLED, _Z3, "_optimizer_states_and_gradient_swap_in", "a checkpoint reads a sub-group's state "
               "through it", params=_SUBGROUP),
    Dependency(Kind.CALLED, _Z3, "_release_swap_buffers", "a checkpoint releases what it read, writing nothing back",
               params=_SUBGROUP),
    Dependency(Kind.CALLED, _Z3, "_optimizer_states_and_gradient_swap_out", "resuming writes a restored sub-group "
               "back", params=_SUBGROUP),
    Dependency(Kind.IMPORTED, "deepspeed.ops.adam", "DeepSpeedCPUAdam", "resuming replays its step counter"),
    Dependency(Kind.ATTRIBUTE, "deepspeed.ops.adam.DeepSpeedCPUAdam", "ds_opt_adam", "the C++ op whose running "
               "beta^t product resuming rebuilds", set_in="__init__"),
    Dependency(Kind.ATTRIBUTE, "deepspeed.ops.adam.DeepSpeedCPUAdam", "opt_id", "which C++ optimizer that is",
               set_in="__init__"),
    Dependency(Kind.CALLED, "deepspeed.comm", "get_world_size", "a checkpoint records the world size", params=()),
    # -- layer-major micro-batches (train.model.layermajor): a layer's parameters held gathered across its calls --
    Dependency(Kind.ATTRIBUTE, _INIT, "ds_active_sub_modules", "a mark in it keeps ZeRO-3 from releasing a layer's "
               "parameters between its micro-batches", set_in="_convert_to_deepspeed_param", on="param"),
    Dependency(Kind.ATTRIBUTE, _INIT, "ds_persist", "persistent parameters are never held or released",
               set_in="_convert_to_deepspeed_param", on="param"),
    Dependency(Kind.ATTRIBUTE, _INIT, "is_external_param", "an external parameter is its owner's to release",
               set_in="_convert_to_deepspeed_param", on="param"),
    Dependency(Kind.ATTRIBUTE, _Z3, "parameter_offload", "the engine's parameter offload, whose coordinator "
               "releases a held layer", set_in="__init__"),
    Dependency(Kind.CALLED, f"{_ZERO}.parameter_offload.DeepSpeedZeRoOffload", "get_param_coordinator",
               "the coordinator that gathered the parameters", params=()),
    # IMPORTED, not CALLED: its nvtx decorator hides the signature (`**kwargs`); memstrata passes the parameter alone.
    Dependency(Kind.IMPORTED, f"{_ZERO}.partitioned_param_coordinator.PartitionedParameterCoordinator",
               "_PartitionedParameterCoordinator__release_param", "releases a held parameter with ZeRO-3's own "
               "checks and its count of gathered elements"),
    # -- the one transformers internal (train.model.hfmodel): its public activation_checkpointing_enable takes
    # only torch's checkpoint, and the offloaded checkpoints need their own function around it (swap.activations) --
    Dependency(Kind.CALLED, "transformers.modeling_utils.PreTrainedModel", "_set_gradient_checkpointing",
               "installs ActivationOffload.checkpoint as every layer's checkpoint function",
               params=("enable", "gradient_checkpointing_func")),
    # -- the optimizer swapper (optimizer.MemstrataOptimizerSwapper) --
    *_recreated(_OPT_SWAPPER, "__init__", {
        "swap_config": "stock keeps the offload config", "aio_config": "stock keeps the aio config",
        "aio_handle": "every stock read and write goes through it", "swap_params_info": "stock's per-tensor records",
        "swap_element_size": "stock's swappable-size test", "swap_folder": "prefix of stock's swap names; ZeRO-3 "
        "reads it", "optimizer": "stock reads the optimizer's state", "min_aio_bytes": "stock's swappable-size test",
        "aligned_bytes": "stock's I/O alignment", "numel_alignment": "stock's I/O alignment",
        "largest_numel": "stock sizes gradient staging by it", "dtype": "stock allocates buffers of it",
        "swap_buffer_manager": "stock allocates and frees every buffer through it",
        "timers": "stock's timers", "timer_names": "stock's timers",
        "print_exclude_list": "stock's debug printing", "gradient_swapper": "stock's gradient swap-out"}),
    Dependency(Kind.OVERRIDDEN, _OPT_SWAPPER, "swap_in_optimizer_state", "serves cached sub-groups from DRAM",
               params=("parameter", "async_parameter")),
    Dependency(Kind.OVERRIDDEN, _OPT_SWAPPER, "swap_out_optimizer_state", "keeps the cached sub-groups in DRAM",
               params=("parameter", "async_swap")),
    Dependency(Kind.OVERRIDDEN, _OPT_SWAPPER, "release_swap_buffers", "cached state buffers are not released",
               params=("parameter",)),
    Dependency(Kind.OVERRIDDEN, _OPT_SWAPPER, "writeback_optimizer_state_and_gradients",
               "DRAM gradients and the cache on write-back", params=("parameter", "write_opt_state",
                                                                     "write_gradients")),
    Dependency(Kind.OVERRIDDEN, _OPT_SWAPPER, "initialize_parameters", "the fp32 master written a chunk at a time "
               "from 16-bit weights in DRAM", params=("parameters", "src_tensors")),
    Dependency(Kind.OVERRIDDEN, _OPT_SWAPPER, "initialize_from_swapped_fp16_params", "fast_init with exact buffers",
               params=("fp16_partitions_info", "fp16_num_elems", "fp16_pinned_buffers", "fp32_parameters")),
    Dependency(Kind.CALLED, _OPT_SWAPPER, "_swap_in_gradients", "a cached sub-group still reads its gradients",
               params=("aio_handle", "parameter", "dest_buffer")),
    Dependency(Kind.CALLED, _BASE_SWAPPER, "_get_param_swap_info", "the record of a sub-group",
               params=("parameter",)),
    Dependency(Kind.CALLED, _BASE_SWAPPER, "_flush_gradient_swapper", "pending gradient writes before a cache hit",
               params=("gradient_swapper",)),
    Dependency(Kind.CALLED, _BASE_SWAPPER, "_io_aligned_numel", "buffer sizes both swappers allocate",
               params=("numel",)),
    Dependency(Kind.CALLED, _BASE_SWAPPER, "_get_swap_paths", "fast_init's swap names", params=("parameters",
                                                                                             "num_elems")),
    Dependency(Kind.OVERRIDDEN, _BUFFERS, "allocate", "ExactBuffers stands in for it; stock calls it by keyword",
               params=("num_elems", "count", "dtype")),
    Dependency(Kind.OVERRIDDEN, _BUFFERS, "allocate_all", "ExactBuffers stands in for it", params=("num_elems",
                                                                                               "dtype")),
    Dependency(Kind.OVERRIDDEN, _BUFFERS, "free", "ExactBuffers stands in for it", params=("buffers",)),
    Dependency(Kind.CALLED, f"{_ST}.async_swapper.AsyncTensorSwapper", "__init__", "the re-created gradient_swapper",
               params=("aio_handle", "numel_alignment", "timers")),
    Dependency(Kind.CALLED, f"{_ST}.utils", "swap_in_tensors", "reads through a handle (called positionally)",
               params=("swap_handle", "tensor_buffers", "swap_paths")),
    Dependency(Kind.CALLED, f"{_ST}.utils", "swap_out_tensors", "the pipelined write-back submits through a "
               "handle (called positionally)", params=("swap_handle", "tensor_buffers", "swap_paths")),
    Dependency(Kind.CALLED, _BASE_SWAPPER, "_swap_out_unpinned_tensors", "the pipelined write-back stages the first "
               "step's moments as stock does", params=("aio_handle", "unpinned_tensors", "dest_paths",
                                                        "pinned_buffers")),
    *[Dependency(Kind.CALLED, _SWAP_INFO, n, "the read-ahead and write-back read a sub-group's swap names", params=p)
      for n, p in (("get_swap_paths", ()), ("get_swap_buffers_and_paths", ("pinned",)))],
    *[Dependency(Kind.ATTRIBUTE, _SWAP_INFO, n, "read and rebound by the DRAM cache", set_in="__init__")
      for n in ("param_id", "swap_buffers", "has_state_tensors")],
    *[Dependency(Kind.CALLED, _SWAP_INFO, n, "the DRAM cache reads a sub-group's record", params=p)
      for n, p in (("num_tensors", ()), ("numel", ()), ("has_gradients", ()), ("get_compute_tensors", ()),
                   ("release_memory", ()), ("release_unswapped_gradients", ()),
                   ("set_swap_buffers", ("buffers", "aligned_numel")))],
    # -- the parameter swapper (parameters.MemstrataParamSwapper) --
    *_recreated(_PARAM_SWAPPER, "_configure_aio", {
        "swap_config": "the offload_param config", "swap_folder": "prefix of stock's swap names",
        "swap_element_size": "stock's swappable-size test", "aio_config": "stock keeps the aio config",
        "use_gds": "stock branches on it", "min_aio_bytes": "stock's swappable-size test",
        "aligned_bytes": "stock's I/O alignment", "numel_alignment": "stock's I/O alignment",
        "elements_per_buffer": "stock's per-buffer ceiling", "aligned_elements_per_buffer": "stock's buffer stride",
        "param_buffer_count": "stock's slot count", "available_buffer_ids": "stock's free slots",
        "reserved_buffer_ids": "stock's reserved slots", "aio_read_handle": "every stock read",
        "aio_write_handle": "every stock write", "buffers": "stock's pinned slab (None: exact buffers instead)",
        "swap_out_params": "stock's pending swap-outs"}),
    Dependency(Kind.SKIPPED, _PARAM_SWAPPER, "aio_handle", "the aio op class; only stock _configure_aio uses it, to "
               "build the two handles memstrata replaces", set_in="_configure_aio"),
    *[Dependency(Kind.ATTRIBUTE, _PARAM_SWAPPER, n, "bookkeeping the exact buffers keep as stock does",
                 set_in="__init__")
      for n in ("dtype", "param_id_to_numel", "param_id_to_buffer_id", "param_id_to_swap_buffer",
                "available_params", "available_numel", "invalid_buffer")],
    Dependency(Kind.ATTRIBUTE, _PARAM_SWAPPER, "id_to_path", "ds_id -> swap name: forget_except frees the extents "
               "of parameters a model replaced after zero.Init built them", set_in="__init__"),
    Dependency(Kind.OVERRIDDEN, _PARAM_SWAPPER, "_configure_aio",
               "no folder, no pinned slab: extents and exact buffers", params=("ds_config",)),
    *[Dependency(Kind.OVERRIDDEN, _PARAM_SWAPPER, n, "exact buffers from the locked pool instead of fixed slots",
                 params=p)
      for n, p in (("available_swap_in_buffers", ()), ("_allocate_and_return_buffers_for_swap_in", ("params",)),
                   ("get_buffer", ("param", "numel")), ("remove_partition_and_release_buffers", ("params",)),
                   ("reserve_available_buffers", ()), ("release_reserved_buffers", ()),
                   ("swap_in", ("params", "async_op", "swap_in_buffers")))],
    Dependency(Kind.CALLED, _PARAM_SWAPPER, "_get_swap_paths", "swap names of the parameters read", params=("params",)),
    Dependency(Kind.OVERRIDDEN, _PARAM_SWAPPER, "reserve_partitioned_swap_space", "no buffer locked for the run: "
               "the write-back after an update takes exact ones", params=("partition_num_elems",)),
    Dependency(Kind.OVERRIDDEN, _PARAM_SWAPPER, "swap_out_partitioned_params", "the 16-bit write-back after an "
               "update through exact buffers", params=("dst_fp16_params", "src_fp32_params")),
    Dependency(Kind.CALLED, _PARAM_SWAPPER, "synchronize_writes", "pending writes before a write-back", params=()),
    Dependency(Kind.CALLED, _PARAM_SWAPPER, "_update_inflight_swap_in", "stock's in-flight bookkeeping (positional)",
               params=("params", "swap_in_buffers", "inflight_numel")),
    Dependency(Kind.CALLED, _PARAM_SWAPPER, "synchronize_reads", "a blocking swap_in", params=()),
    Dependency(Kind.IMPORTED, f"{_ST}.partitioned_param_swapper.PartitionedParamStatus", "NOT_AVAILABLE",
               "the status a released or not-yet-read partition has"),
    # -- the update beside the next forward (overlap) --
    *[Dependency(Kind.ATTRIBUTE, _Z3, n, "whether the update may run beside the forward", set_in="__init__")
      for n in ("persistent_parameters", "zero_hpz_partition_size")],
    Dependency(Kind.ATTRIBUTE, _Z3, "module", "the forward's parameter order", set_in="__init__"),
    Dependency(Kind.ATTRIBUTE, _Z3, "optimizer", "its param groups, read by the update as of its step",
               set_in="__init__"),
    *[Dependency(Kind.WRAPPED, _Z3, n, "joins the update first", params=p)
      for n, p in (("state_dict", ()), ("load_state_dict", ("state_dict_list", "load_optimizer_states",
                                                             "load_from_fp32_weights", "checkpoint_folder",
                                                             "load_serial", "param_shapes")))],
    *[Dependency(Kind.WRAPPED, "deepspeed.runtime.engine.DeepSpeedEngine", n, "joins the update first", params=p)
      for n, p in (("forward", ("*inputs", "**kwargs")), ("backward", ("loss", "retain_graph", "scale_wrt_gas")),
                   ("save_checkpoint", ("save_dir", "tag", "client_state", "save_latest",
                                        "exclude_frozen_parameters")),
                   ("load_checkpoint", ("load_dir", "tag", "load_module_strict", "load_optimizer_states",
                                        "load_lr_scheduler_states", "load_module_only", "custom_load_fn")),
                   ("save_16bit_model", ("save_dir", "save_filename", "exclude_frozen_parameters")),
                   ("destroy", ()))],
    *[Dependency(Kind.ATTRIBUTE, _INIT, n, "wrapped on each trainable parameter: waits for its sub-group's update",
                 set_in="_convert_to_deepspeed_param", on="param") for n in ("all_gather", "all_gather_coalesced")],
    Dependency(Kind.ATTRIBUTE, _INIT, "final_location", "weights on NVMe keep the update in place",
               set_in="_partition_param", on="param.ds_tensor"),
    Dependency(Kind.IMPORTED, f"{_ZERO}.offload_config", "OffloadDeviceEnum", "where a partition lives"),
    Dependency(Kind.IMPORTED, f"{_ZERO}.offload_config.OffloadDeviceEnum", "nvme", "a partition on NVMe"),
    Dependency(Kind.CALLED, _ACCEL, "set_device", "the update thread's device", params=("device_index",)),
    Dependency(Kind.CALLED, _ACCEL, "current_stream", "the update thread's copies, waited before the forward",
               params=()),
    Dependency(Kind.ATTRIBUTE, _INIT, "ds_id", "the parameter's key in every swapper map",
               set_in="_convert_to_deepspeed_param", on="param"),
    Dependency(Kind.ATTRIBUTE, _INIT, "ds_tensor", "the partition a swap-in fills", set_in="_partition_param",
               on="param"),
    Dependency(Kind.ATTRIBUTE, _INIT, "status", "whether a partition is available, in flight or on NVMe",
               set_in="_partition_param", on="param.ds_tensor"),
)

