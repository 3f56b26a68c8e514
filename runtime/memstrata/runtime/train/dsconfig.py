"""The DeepSpeed config of a stock ZeRO-Infinity run, derived from the plan and the job.

Stock ZeRO-3 with NVMe offload does not run with its defaults (measured with DeepSpeed 0.19.8):
its parameter swapper refuses tensors larger than `buffer_size`, runs out of
swap buffers when parameters stay live, silently keeps small tensors in DRAM,
and pins gigabytes of host memory for a model of any size. Every setting that
differs from DeepSpeed 0.19.8's default is recorded as a `Setting` with the
reason, so the report says exactly what the baseline was run with.

Pure: no I/O, no torch import.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import Training
from memstrata.api.strataplan import STOCK_SWAP_FIX, Plan
from memstrata.plan.accounting import (
    DS_REDUCE_BUCKET_ELEMENTS, memstrata_subgroup_elements, reduce_bucket_elements,
)
from memstrata.plan.stock import (
    DS_ALIGN_ELEMENTS, OPTIMIZER_BUFFER_COUNT, align_elements, largest_param, param_buffer_count, param_tensors,
    sub_group_size,
)

AIO_BLOCK_SIZE = 1 << 20
AIO_QUEUE_DEPTH = 8

class Setting(BaseModel):
    """One non-default DeepSpeed setting and why it has the value it has."""

    key: str
    value: Any
    default: Any
    why: str


class DsConfig(BaseModel):
    config: dict[str, Any]
    settings: list[Setting]
    offload_param: str
    offload_optimizer: str


def deepspeed_swap_refusal(plan: Plan, *, granted: Sequence[str], swap_dir: Path, swap_dir_on_root: bool) -> str | None:
    """Why a run of `plan` must not start here, or None.

    Stock ZeRO-Infinity swaps to files under `nvme_path`, a directory. Where the device plugin `granted` namespaces,
    the NVMe stratum is raw devices, which it cannot use: `Plan.stock_swap_refusal` says why, in the words the
    operator's placement uses too. In a pod granted none, `swap_dir` is on the container's root filesystem
    (`swap_dir_on_root`), which the swap would fill and lose with the container. A plan that offloads nothing to
    NVMe (or is memstrata's) writes no swap file and is fine anywhere; a local run's own scratch directory is
    where the user asked DeepSpeed to swap."""
    refusal = plan.stock_swap_refusal()
    if refusal is None or granted:
        return refusal
    if swap_dir_on_root:
        return (f"spec.memory.engine: deepspeed would swap the {' and '.join(plan.deepspeed_swapped())} the plan puts "
                f"on NVMe to {swap_dir}, on the container's root filesystem (the pod was granted no NVMe namespace); "
                f"{STOCK_SWAP_FIX}")
    return None


def offload_devices(plan: Plan) -> tuple[str, str]:
    """(offload_param.device, offload_optimizer.device) of a run of `plan`.

    Stock DeepSpeed offloads a whole group to one device, so a group with any byte on NVMe goes there whole.
    memstrata's engine honours the plan per byte instead: its optimizer swapper keeps the sub-groups the plan
    puts in DRAM resident there for good and streams only the rest, so it always manages the optimizer state
    (device nvme, even when nothing spills: then no namespace is opened at all), and its parameter swapper keeps
    the plan's DRAM share of the weights resident, so the weights go through it only when some of them spill."""
    param = plan.offload_device("weights")
    optimizer = "nvme" if plan.engine == "memstrata" else plan.offload_device("master", "optimizer")
    return param, optimizer


# What DeepSpeed builds when a key is absent: the optimizer state is always offloaded here, so its AdamW is
# DeepSpeedCPUAdam, whose defaults these are.
CPU_ADAM_DEFAULTS: dict[str, Any] = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def _adamw_params(training: Training, note: Note) -> dict[str, Any]:
    """AdamW's hyperparameters from spec.training.optimizer; the learning rate is the schedule's peak (the
    scheduler multiplies it every step)."""
    opt = training.optimizer
    return {
        "lr": training.learning_rate,
        "betas": note("optimizer.params.betas", [opt.beta1, opt.beta2], CPU_ADAM_DEFAULTS["betas"],
                      "from spec.training.optimizer.beta1/beta2 (memstrata's default beta2 0.95 forgets old "
                      "gradient scales faster than 0.999 over a short fine-tune)"),
        "eps": note("optimizer.params.eps", opt.eps, CPU_ADAM_DEFAULTS["eps"], "from spec.training.optimizer.eps"),
        "weight_decay": note("optimizer.params.weight_decay", opt.weight_decay, CPU_ADAM_DEFAULTS["weight_decay"],
                             "from spec.training.optimizer.weightDecay: decoupled (AdamW) decay of every "
                             "parameter"),
    }


class Note:
    """Collects the `Setting`s of one config: `note(key, value, default, why)` records one and returns `value`."""

    def __init__(self) -> None:
        self.settings: list[Setting] = []

    def __call__(self, key: str, value: Any, default: Any, why: str) -> Any:
        self.settings.append(Setting(key=key, value=value, default=default, why=why))
        return value

    def differences(self) -> list[Setting]:
        """Only real differences from DeepSpeed's defaults (and the aio block, always shown)."""
        return [s for s in self.settings if s.value != s.default or s.key.startswith("aio.")]


def batch_config(micro_batch: int, accumulation: int, world: int, layer_major: bool) -> dict[str, int]:
    """DeepSpeed's three batch settings for `accumulation` micro-batches of `micro_batch` per rank and step: layer-major,
    one forward of them all, stacked (memstrata.runtime.train.model.layermajor)."""
    micro, steps = (micro_batch * accumulation, 1) if layer_major else (micro_batch, accumulation)
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps,
            "train_batch_size": micro * steps * world}


def build_ds_config(plan: Plan, arch: ModelArchitecture, training: Training, swap_dir: Path,
                    on_gpu: bool, world: int = 1, *, layer_major: bool = False) -> DsConfig:
    """The ds_config for one rank of `world` running `training` with `plan`'s offload devices (microBatch and
    gradientAccumulation are per rank, so the global batch is their product times `world`); `layer_major`: the
    runtime runs the step's micro-batches layer-major (the plan's choice, where the model's loss allows it)."""
    note = Note()
    param_dev, optim_dev = offload_devices(plan)
    # In the order the record lists them: offload, sub-groups and buckets, precision, then the rest.
    offload_param = _offload_param(note, plan, arch, param_dev, swap_dir, on_gpu)
    offload_optimizer = _offload_optimizer(note, plan, optim_dev, swap_dir, on_gpu)
    sub_group = _sub_group(note, plan, arch)
    zero = {**_stage3(note), "offload_param": offload_param, "offload_optimizer": offload_optimizer,
            "sub_group_size": sub_group, **_buckets(note, arch)}
    precision = _precision(note, training)
    batch = batch_config(training.micro_batch, training.gradient_accumulation, world, layer_major)
    if layer_major:
        # DeepSpeed has no default batch; None shows the setting with its reason.
        note("train_micro_batch_size_per_gpu", batch["train_micro_batch_size_per_gpu"], None,
             f"layer-major: DeepSpeed sees the step's {training.gradient_accumulation} micro-batches as one forward and "
             "one backward (and gradient_accumulation_steps 1); each micro-batch runs every layer alone "
             "(memstrata.runtime.train.model.layermajor)")
    config: dict[str, Any] = {
        **batch,
        "steps_per_print": note("steps_per_print", 1 << 30, 10,
                                "memstrata's progress bar reports every step; DeepSpeed's own lines would break it"),
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": _adamw_params(training, note)},
        "gradient_clipping": note("gradient_clipping", training.gradient_clipping, 0.0,
                                  "from spec.training.gradientClipping: the global gradient norm is clipped to it "
                                  "(the default 1.0 keeps an early large gradient from derailing a short run)"),
        **precision,
        "zero_optimization": zero,
        "aio": _aio(note),
    }
    return DsConfig(config=config, settings=note.differences(), offload_param=param_dev, offload_optimizer=optim_dev)


def _pinned(note: Note, key: str, plan: Plan, on_gpu: bool) -> bool:
    # Stock: torch's pin_memory() needs an accelerator (on a CPU-only node it raises). memstrata's engine serves
    # every pin from its exact pools (memstrata.runtime.swap.pinning), on the CPU too.
    why = ("memstrata's engine: what ZeRO-3 pins comes from its exact-size pools, placed where the plan put it "
           "and registered with the GPU (never torch's power-of-two pinned allocator)" if plan.engine == "memstrata"
           else "pinned host memory needs an accelerator; without a GPU torch refuses to pin")
    return bool(note(f"zero_optimization.{key}.pin_memory", on_gpu or plan.engine == "memstrata", True, why))


def _offload_param(note: Note, plan: Plan, arch: ModelArchitecture, device: str, swap_dir: Path,
                   on_gpu: bool) -> dict[str, Any]:
    largest, tensors = largest_param(arch), param_tensors(arch)
    offload: dict[str, Any] = {
        "device": note("zero_optimization.offload_param.device", device, "none",
                       "from the plan: nvme when any byte of the 16-bit weights is placed on NVMe, else cpu"),
        "pin_memory": _pinned(note, "offload_param", plan, on_gpu),
    }
    if device != "nvme":
        return offload
    buffer_size = note(
        "zero_optimization.offload_param.buffer_size", align_elements(largest), int(1e8),
        f"every parameter is swapped in whole into one buffer, so it must hold the largest tensor "
        f"({largest} elements, aligned to {DS_ALIGN_ELEMENTS}); 1e8 would pin 5 x 200 MB for nothing")
    buffer_count = note(
        "zero_optimization.offload_param.buffer_count", param_buffer_count(arch), 5,
        f"one buffer per parameter tensor in flight; 5 ran gpt-tiny here, 8 leaves the prefetcher room "
        f"(with too few the swapper asserts 'Not enough buffers'); never more than the "
        f"model's {tensors} tensors")
    # DeepSpeed's own swap folder (stock ZeRO-Infinity's files); memstrata's engine never reads it back.
    return {**offload, "nvme_path": str(swap_dir), "buffer_size": buffer_size, "buffer_count": buffer_count,
            "max_in_cpu": note("zero_optimization.offload_param.max_in_cpu", 0, int(1e9),
                               "no cached parameter copies in DRAM beyond the swap buffers (memstrata's engine keeps "
                               "the plan's DRAM share of the weights resident by itself)")}


def _offload_optimizer(note: Note, plan: Plan, device: str, swap_dir: Path, on_gpu: bool) -> dict[str, Any]:
    offload: dict[str, Any] = {
        "device": note("zero_optimization.offload_optimizer.device", device, "none",
                       "from the plan (offload_devices): stock, nvme when any byte of the fp32 master weights or Adam "
                       "moments is on NVMe; memstrata's engine, always nvme (it keeps the plan's DRAM share resident)"),
        "pin_memory": _pinned(note, "offload_optimizer", plan, on_gpu),
    }
    if device == "nvme":
        offload.update(nvme_path=str(swap_dir), buffer_count=OPTIMIZER_BUFFER_COUNT, pipeline_read=False,
                       pipeline_write=False)
    return offload


def _stage3(note: Note) -> dict[str, Any]:
    return {"stage": note("zero_optimization.stage", 3, 0,
                          "ZeRO-3 is the only stage that offloads parameters; ZeRO-2 with offload_optimizer nvme "
                          "silently falls back to CPU and writes no swap files")}


def _sub_group(note: Note, plan: Plan, arch: ModelArchitecture) -> int:
    # The planner sizes the locked buffers from the same sub-group size (memstrata.plan.accounting).
    if plan.engine == "memstrata":
        return int(note(
            "zero_optimization.sub_group_size", plan.sub_group_elements or memstrata_subgroup_elements(arch), int(1e9),
            "memstrata's engine: about one transformer layer per sub-group (less where the plan's DRAM budget needs "
            "smaller update buffers), a big tensor (the embedding) alone and updated a slice at a time "
            "(memstrata.plan.accounting.group_tensors), so the streamed ones need small buffers"))
    return int(note(
        "zero_optimization.sub_group_size", sub_group_size(arch), int(1e9),
        "the optimizer swapper pins buffer_count x sub-group fp32 elements and streams one sub-group at a "
        "time: one transformer layer per sub-group bounds that to the planner's estimate (1e9 pins 16 GB); at "
        "least the largest tensor, and at least 1 MiB of fp32, because DeepSpeed never swaps a smaller tensor "
        "to NVMe"))


def _buckets(note: Note, arch: ModelArchitecture) -> dict[str, Any]:
    largest = largest_param(arch)
    return {
        "stage3_param_persistence_threshold": note(
            "zero_optimization.stage3_param_persistence_threshold", 0, int(1e5),
            "tensors below the threshold are never partitioned or offloaded; 0 sends every tensor where the plan "
            "says, so small models really exercise the NVMe path"),
        "stage3_max_reuse_distance": note(
            "zero_optimization.stage3_max_reuse_distance", 0, int(1e9),
            "a parameter reused within this many elements stays gathered and keeps its swap buffer; 0 releases "
            "it after use so the buffer pool bounds what is live (a 162M-parameter GPT died with the default "
            "at step 1: 'Not enough buffers 0 for swapping 1'). Cost measured on gpt-tiny: ~2x fewer tokens/s than "
            "the default, which re-reads nothing"),
        "stage3_prefetch_bucket_size": note(
            "zero_optimization.stage3_prefetch_bucket_size", align_elements(largest), int(5e7),
            "prefetch about one largest tensor ahead: enough to overlap I/O, small enough to leave buffers free"),
        "reduce_bucket_size": note(
            "zero_optimization.reduce_bucket_size", reduce_bucket_elements(arch), DS_REDUCE_BUCKET_ELEMENTS,
            "gradients are gathered in this bucket on the GPU before they are reduced and copied to the host; it is "
            "allocated whole (5e8 is 0.93 GiB of bf16 for a model of any size): one layer's worth, which the plan "
            "counts in the GPU working set"),
        "stage3_max_live_parameters": note(
            "zero_optimization.stage3_max_live_parameters", max(2 * arch.layer_params(), 2 * largest), int(1e9),
            "about two layers gathered at once, as the planner's working-set estimate assumes"),
    }


def _precision(note: Note, training: Training) -> dict[str, Any]:
    precision = training.precision
    fp16: dict[str, Any] = {"enabled": precision == "fp16"}
    if precision == "fp16":
        fp16["initial_scale_power"] = note("fp16.initial_scale_power", 12, 16,
                                           "start the loss scale at 4096: fewer skipped overflow steps early on")
    return {"bf16": {"enabled": precision == "bf16"}, "fp16": fp16}


def _aio(note: Note) -> dict[str, Any]:
    return {
        "block_size": note("aio.block_size", AIO_BLOCK_SIZE, AIO_BLOCK_SIZE,
                           "1 MiB: DeepSpeed's default, the size at which NVMe reaches its sequential bandwidth"),
        "queue_depth": AIO_QUEUE_DEPTH,
        "intra_op_parallelism": note("aio.intra_op_parallelism", 1, 1,
                                     "one I/O thread per handle: the node has 2 cores, both busy with compute"),
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
