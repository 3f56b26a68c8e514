"""Pinned host memory: what memstrata's swap layer locks in training vs DeepSpeed ZeRO-3's NVMe swap pools.

Run (root, or a high enough RLIMIT_MEMLOCK):
    python benchmarks/io/pinned.py

Computed for every preset from the model's real parameter list (memstrata's
transformers model built on the meta device, so no weights are allocated):

- DeepSpeed: its own config classes (DeepSpeedZeroConfig with offload_param /
  offload_optimizer on nvme) give buffer_count and sub_group_size;
  offload_param.buffer_size is raised to the largest parameter's numel, which
  DeepSpeed requires. The parameter swapper locks buffer_count x aligned
  buffer_size 16-bit elements; the optimizer swapper locks buffer_count x
  the largest sub-group (stage 3's own packing rule) of fp32. Both for the
  whole run, from construction on.
- memstrata: the two LockedPools SwapLayer builds
  (memstrata.runtime.swap.layer.locked_pool, default SwapSettings), replayed
  through two training steps of one rank the way memstrata's swappers call
  them (`replay` below): init (per sub-group the optimizer swapper's two
  spare buffers of the largest sub-group), forward and backward (one exact buffer per swapped parameter, the
  prefetcher taking more while param_staging_bytes has room for the largest),
  and the update (per sub-group 3 fp32 state buffers + 1 fp32 gradient
  buffer, the cache_subgroups sub-groups walked last kept, then trim()).
  The peak is the most the two pools hold locked at once.

Computed rows replay with unlocked pools (address space only: nothing is
touched; locked_bytes counts their regions). For the GPT presets both sides
are also really allocated, each in its own subprocess, and VmLck
(/proc/self/status) is read before and after every allocation: memstrata's
replay with mlock'ed pools, DeepSpeed the way its swappers do it
(aio_handle.new_cpu_locked_tensor for the parameter pool, SwapBufferManager
for the optimizer pool). A whole training run's locked peak is in
benchmarks/offload (peak locked GiB). Results go to the "pinned" key of
benchmarks/results/io.json; io.md is re-rendered.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "runtime"), str(REPO / "operator")]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO / "benchmarks")]

from memstrata.api.architecture import PRESETS  # noqa: E402
from memstrata.plan.stock import param_buffer_count, sub_group_size  # noqa: E402

COMPUTED = ["llama3-8b", "qwen2.5-14b", "gpt-125m", "gpt-350m"]
MEASURED = ["gpt-125m", "gpt-350m"]
AIO_ALIGNED_BYTES = 1024  # deepspeed.runtime.swap_tensor.utils.AIO_ALIGNED_BYTES (intra_op_parallelism 1)
PAGE = 4096


def param_numels(preset: str) -> list[tuple[str, int]]:
    """(name, numel) of every parameter tensor, in registration order (the order ZeRO-3 packs sub-groups)."""
    import torch

    from memstrata.runtime.train.model.hfmodel import random_model

    with torch.device("meta"):
        model = random_model(PRESETS[preset], 2048, seed=0)
    return [(n, p.numel()) for n, p in model.named_parameters()]


def sub_groups(numels: list[int], sub_group: int) -> list[int]:
    """Sub-group sizes in order. stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups packs
    tensors in registration order until a group reaches sub_group_size."""
    groups, acc = [], 0
    for i, n in enumerate(numels):
        acc += n
        if acc >= sub_group or i == len(numels) - 1:
            groups.append(acc)
            acc = 0
    return groups


def aligned(numel: int, elem_bytes: int, align_bytes: int = AIO_ALIGNED_BYTES) -> int:
    unit = align_bytes // elem_bytes  # _io_aligned_numel of the swappers (DeepSpeed 1 KiB, memstrata 4 KiB)
    return -(-numel // unit) * unit


def deepspeed_sizes(preset: str, params: list[tuple[str, int]]) -> dict[str, Any]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    largest = max(n for _, n in params)
    count = param_buffer_count(PRESETS[preset])
    zero = DeepSpeedZeroConfig(stage=3, offload_param={"device": "nvme", "nvme_path": "/nvme", "buffer_count": count,
                                                       "buffer_size": largest},
                               offload_optimizer={"device": "nvme", "nvme_path": "/nvme"})
    op, oo = zero.offload_param, zero.offload_optimizer
    sub = max(sub_groups([n for _, n in params], int(zero.sub_group_size)))
    return {"param_buffer_count": op.buffer_count, "param_buffer_elems": aligned(op.buffer_size, 2),
            "optimizer_buffer_count": oo.buffer_count, "sub_group_size": int(zero.sub_group_size),
            "optimizer_buffer_elems": aligned(sub, 4),
            "param_bytes": op.buffer_count * aligned(op.buffer_size, 2) * 2,
            "optimizer_bytes": oo.buffer_count * aligned(sub, 4) * 4}


class Peak:
    """The most the pools hold locked at once, by phase; VmLck too when `measure` (real mlock)."""

    def __init__(self, pools: tuple[Any, Any], measure: bool) -> None:
        self.pools, self.measure = pools, measure
        self.base = _vm_lck() if measure else 0
        self.phase = "init"
        self.by_phase: dict[str, int] = {}
        self.vmlck_by_phase: dict[str, int] = {}

    def sample(self) -> None:
        held = sum(p.locked_bytes for p in self.pools)
        self.by_phase[self.phase] = max(self.by_phase.get(self.phase, 0), held)
        if self.measure:
            added = _vm_lck() - self.base
            self.vmlck_by_phase[self.phase] = max(self.vmlck_by_phase.get(self.phase, 0), added)


def replay(preset: str, params: list[tuple[str, int]], *, lock: bool) -> dict[str, Any]:
    """Drive the swap layer's pools through fast init and two steps the way memstrata's swappers do."""
    import torch

    from memstrata.runtime.strata.affinity import TensorKind
    from memstrata.runtime.swap.layer import SwapSettings, locked_pool

    settings = SwapSettings(lock_memory=lock)
    opt_pool, param_pool = locked_pool(settings, TensorKind.OPTIMIZER), locked_pool(settings, TensorKind.PARAM_STAGING)
    peak = Peak((opt_pool, param_pool), measure=lock)
    half, fp32 = torch.bfloat16, torch.float32

    def take(pool: Any, numel: int, dtype: Any) -> Any:
        t = pool.tensor(aligned(numel, dtype.itemsize, PAGE), dtype)  # both swappers align to 4 KiB
        peak.sample()
        return t

    def give(pool: Any, tensors: list[Any]) -> None:
        # Popped, so no reference outlives the free: a region unmaps only once its last view is gone.
        while tensors:
            pool.free(tensors.pop())

    groups = sub_groups([n for _, n in params], sub_group_size(PRESETS[preset]))
    # Init (stage 3 without fast_init, DeepSpeed's default and memstrata's): each sub-group's fp32 master is
    # written out through allocate_all, the optimizer swapper's spare_count (2) buffers of the largest sub-group.
    for _ in groups:
        give(opt_pool, [take(opt_pool, max(groups), fp32) for _ in range(2)])
    swapped = [n for _, n in params if n * half.itemsize >= settings.min_swap_bytes]
    largest = max(swapped) * half.itemsize
    cached: dict[int, list[Any]] = {}
    for step in range(2):
        # Forward then backward (MemstrataParamSwapper): an exact buffer per partition in use, and prefetch
        # while available_swap_in_buffers() > 0, i.e. the staging budget still has room for the largest.
        for peak.phase, order in (("forward", swapped), ("backward", swapped[::-1])):
            live: dict[int, Any] = {}
            for i, n in enumerate(order):
                if i not in live:
                    live[i] = take(param_pool, n, half)
                ahead = i + 1
                while ahead < len(order) and (settings.param_staging_bytes - param_pool.in_use) // largest > 0:
                    live.setdefault(ahead, take(param_pool, order[ahead], half))
                    ahead += 1
                param_pool.free(live.pop(i))
        # Update (MemstrataOptimizerSwapper + DramGradients): state in, gradients widened from DRAM, state out;
        # sub-groups walked in alternating order and the last cache_subgroups of them kept for the next step.
        peak.phase = "update"
        walk = list(range(len(groups)))[:: 1 if step % 2 == 0 else -1]
        keep = set(walk[len(walk) - settings.cache_subgroups:]) if settings.cache_subgroups else set()
        for gi in walk:
            state = cached.pop(gi, None) or [take(opt_pool, groups[gi], fp32) for _ in range(3)]
            give(opt_pool, [take(opt_pool, groups[gi], fp32)])  # its fp32 gradients, widened from DRAM
            if gi in keep:
                cached[gi] = state
            else:
                give(opt_pool, state)
        opt_pool.trim()  # trim_after_step
        peak.sample()
    out = {"sub_groups": len(groups), "largest_sub_group": max(groups), "peak_by_phase": peak.by_phase,
           "peak_bytes": max(peak.by_phase.values()),
           "settings": settings.model_dump(include={"pool_chunk_bytes", "param_staging_bytes", "cache_subgroups",
                                                    "min_swap_bytes"})}
    if lock:
        out["vmlck_by_phase"] = peak.vmlck_by_phase
        out["vmlck_peak_bytes"] = max(peak.vmlck_by_phase.values())
    return out


def _vm_lck() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmLck in /proc/self/status")


def _allocate(who: str, preset: str) -> None:
    """Child process: allocate one side's buffers for real and print the most VmLck it added."""
    import torch

    params = param_numels(preset)
    if who == "memstrata":
        print(json.dumps({"vmlck_added_bytes": replay(preset, params, lock=True)["vmlck_peak_bytes"]}))
        return
    before = _vm_lck()
    keep: list[Any] = []
    if who == "deepspeed":
        import deepspeed.comm as dist
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.runtime.swap_tensor.utils import SwapBufferManager

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_distributed(dist_backend="gloo", verbose=False)  # SwapBufferManager asks for the rank
        d = deepspeed_sizes(preset, params)
        handle = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
        # partitioned_param_swapper: one torch.empty of count x aligned buffer, then re-made locked by the handle.
        template = torch.empty(d["param_buffer_elems"] * d["param_buffer_count"], dtype=torch.float16)
        keep.append(handle.new_cpu_locked_tensor(template.numel(), template))
        del template
        keep.append(SwapBufferManager(num_elems=d["optimizer_buffer_elems"], count=d["optimizer_buffer_count"],
                                      dtype=torch.float32, aio_handle=handle))
    print(json.dumps({"vmlck_added_bytes": _vm_lck() - before}))


def measure(who: str, preset: str) -> int:
    out = subprocess.run([sys.executable, __file__, "--allocate", who, preset], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{who} allocation for {preset} failed: {out.stderr[-2000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["vmlck_added_bytes"])


def main() -> None:
    cases: list[dict[str, Any]] = []
    for preset in COMPUTED:
        params = param_numels(preset)
        ds = deepspeed_sizes(preset, params)
        ms = replay(preset, params, lock=False)
        d_total, m_total = ds["param_bytes"] + ds["optimizer_bytes"], ms["peak_bytes"]
        cases.append({"model": preset, "source": "computed", "parameters": sum(n for _, n in params),
                      "largest_param_numel": max(n for _, n in params), "memstrata_bytes": m_total,
                      "deepspeed_bytes": d_total, "ratio_vs_deepspeed": m_total / d_total,
                      "memstrata": ms, "deepspeed": ds})
        if preset in MEASURED:
            m_meas, d_meas = measure("memstrata", preset), measure("deepspeed", preset)
            cases.append({"model": preset, "source": "measured VmLck", "memstrata_bytes": m_meas,
                          "deepspeed_bytes": d_meas, "ratio_vs_deepspeed": m_meas / d_meas,
                          "memstrata_measured_vs_computed": m_meas / m_total,
                          "deepspeed_measured_vs_computed": d_meas / d_total})
        print(f"{preset}: done", file=sys.stderr)
    pinned = {
        "target": "memstrata locked bytes / DeepSpeed locked bytes <= 0.5",
        "loadavg_1_5_15": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]],
        "method": (
            "DeepSpeed: DeepSpeedZeroConfig(stage=3, offload_param nvme with buffer_count = memstrata's plan of a "
            "stock run and buffer_size = largest parameter numel, offload_optimizer nvme) with every other value its "
            "default (optimizer buffer_count 4, sub_group_size 1e9); param pool = buffer_count x aligned buffer_size "
            "x 2 B, optimizer pool = buffer_count x largest sub-group (stage 3 packing) x 4 B, locked from "
            "construction on. memstrata: the two LockedPools SwapLayer builds (swap.layer.locked_pool, default "
            "SwapSettings: 32 MiB chunks, 256 MiB parameter staging, 1 cached sub-group), replayed through init "
            "(2 spare fp32 buffers of the largest sub-group) and two steps the way the swappers call them (exact "
            "4 KiB-aligned buffer per swapped parameter with prefetch inside the staging budget; per sub-group of "
            "memstrata's sub_group_size 3 fp32 state buffers + 1 fp32 gradient buffer; trim after each update); "
            "the peak of both pools' locked bytes at once, by phase in io.json. Measured rows: VmLck added by "
            "really allocating each side in its own subprocess "
            "(memstrata: the same replay with mlock'ed pools, VmLck read after every allocation; DeepSpeed: "
            "aio_handle.new_cpu_locked_tensor for the parameter pool and SwapBufferManager for the optimizer pool). "
            "Not counted on either side: the 16-bit write-back after the update and activation checkpoints; a whole "
            "run's locked peak is benchmarks/offload's."),
        "cases": cases,
    }
    res = REPO / "benchmarks" / "results" / "io.json"
    out = json.loads(res.read_text()) if res.exists() else {"benchmark": "io"}
    out["pinned"] = pinned
    res.write_text(json.dumps(out, indent=2) + "\n")
    from report import render

    print(render(res.parent))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--allocate":
        _allocate(sys.argv[2], sys.argv[3])
    else:
        main()
