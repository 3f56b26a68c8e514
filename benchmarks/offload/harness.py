"""One ZeRO-3 training run with parameters and optimizer state on NVMe, on either engine.

    python benchmarks/offload/harness.py --engine memstrata --preset gpt-tiny --steps 20 \
        --swap-dir /tmp/x --nvme /dev/loop3 --out result.json

`--engine stock` is plain `deepspeed.initialize` (swap files under --swap-dir);
`--engine memstrata` is `memstrata.runtime.initialize` with the same model,
seed, data and ds_config. The result JSON holds the loss of every step, the
phase times, time to first step, and what the swap layer moved. Used by
tests/offload (correctness) and benchmarks/offload/run.py (measurements).

`--gpu` runs both engines as they run on a GPU node: cuda:0 with NCCL, inputs on
the device, `pin_memory` on (stock pins through torch's allocator, memstrata
serves the pins from its pools), activation checkpointing on (stock: torch's
checkpoint, the checkpoints stay on the GPU; memstrata: its activation offload),
the model built under zero.Init, phase times synchronized with the device, and
the device's memory peak (reserved and outside torch's allocator) recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diskstats import deltas, snapshot  # noqa: E402

ALIGN = 1024


class PhaseMemory(threading.Thread):
    """Peak RSS of this process per phase (init/forward/backward/update), sampled every 20 ms: the breakdown
    that says which phase sets the peak the benchmark's process-tree sampler reports."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.phase = "init"
        self.peaks: dict[str, int] = {}

    def run(self) -> None:
        while True:
            with open("/proc/self/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(0.02)


# A world of one rank: its store listens on port 0, resolved by the kernel when it binds (a port found free first
# could be taken by another process's connection in between; it failed a run of make test so).
LONE_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}


def ds_config(arch: Any, *, swap_dir: str, batch: int, precision: str, profile: str, param_device: str = "nvme",
              optim_device: str = "nvme", pin: bool = False) -> dict[str, Any]:
    """The ds_config both engines get. `profile`: 'literal' (DeepSpeed's defaults exactly, which fail on
    some models), 'default' (DeepSpeed's defaults with only what it needs to run at all) or 'tuned' (the
    settings memstrata's dsconfig uses for stock runs: its buffer counts from memstrata.plan.stock).
    `param_device`/`optim_device`: where offload_param/offload_optimizer go ('nvme' or 'cpu'); `pin`: their
    pin_memory (on a GPU, as both engines run there)."""
    from memstrata.plan.stock import OPTIMIZER_BUFFER_COUNT, param_buffer_count

    largest = max(arch.largest_tensor(), arch.max_positions * arch.hidden)
    aligned = -(-largest // ALIGN) * ALIGN
    layer = arch.layer_params()
    param: dict[str, Any] = {"device": param_device, "pin_memory": pin}
    optim: dict[str, Any] = {"device": optim_device, "pin_memory": pin}
    for section in (param, optim):
        if section["device"] == "nvme":
            section["nvme_path"] = swap_dir
    zero: dict[str, Any] = {"stage": 3, "offload_param": param, "offload_optimizer": optim}
    if profile == "literal":
        pass  # DeepSpeed's own defaults untouched: buffer_size 1e8, buffer_count 5, sub_group_size 1e9
    elif profile == "default":
        # buffer_size must hold the largest tensor or stock refuses to start.
        if param_device == "nvme":
            param.update(buffer_size=max(aligned, int(1e8)))
    else:
        if param_device == "nvme":
            param.update(buffer_size=aligned, buffer_count=param_buffer_count(arch), max_in_cpu=0)
        if optim_device == "nvme":
            optim.update(buffer_count=OPTIMIZER_BUFFER_COUNT)
        zero.update(sub_group_size=max(layer, largest, (1 << 20) // 4), stage3_param_persistence_threshold=0,
                    stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=aligned,
                    stage3_max_live_parameters=max(2 * layer, 2 * largest),
                    # Gradients are copied into this bucket before they are partitioned; DeepSpeed's 5e8
                    # elements means every gradient of a small model touches the bucket: one layer's worth.
                    reduce_bucket_size=max(layer, largest))
    return {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "train_batch_size": batch,
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 12},
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True, "use_gds": False},
    }


def build_zero3(arch: Any, cfg: dict[str, Any], args: argparse.Namespace, swap: dict[str, Any]) -> tuple[Any, Any]:
    """(model, swap layer or None): the model built under zero.Init in the training dtype, as the runtime's
    recipe builds it (memstrata: the layer opened first, the model constructed straight into it)."""
    import contextlib

    import torch

    from memstrata.runtime.train.model.hfmodel import build_model, preset_config

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
    layer = None
    if args.engine == "memstrata":
        from memstrata.runtime.swap.integration import constructing, open_layer

        layer = open_layer(cfg, swap, numel=arch.parameters())
    try:
        with constructing(layer) if layer is not None else contextlib.nullcontext():
            offload = layer.activation_offload().checkpoint if layer is not None and args.checkpointing else None
            model = build_model(preset_config(arch, args.seq), cfg, dtype, checkpointing=args.checkpointing,
                                seed=args.seed, checkpoint_function=offload)
    except BaseException:
        if layer is not None:
            layer.close()
        raise
    return model, layer


def micro_steps(engine: Any, micro: list[Any], waves: Any, clock: Any, mem: PhaseMemory
                ) -> tuple[list[float], float, float]:
    """Forward and backward of a step's micro-batches (`waves`: memstrata's LayerMajor, which takes them stacked
    as one), each but the last followed by DeepSpeed's step, which only counts it; (losses, forward s, backward
    s). The caller runs the last step() itself."""
    import contextlib

    import torch

    batches = [torch.cat(micro)] if waves is not None else micro
    losses, forward, backward = [], 0.0, 0.0
    for i, ids in enumerate(batches):
        mem.phase = "forward"
        clock.start()
        with waves.step() if waves is not None else contextlib.nullcontext():
            loss = engine(input_ids=ids, labels=ids).loss
        forward += clock.lap()
        mem.phase = "backward"
        waves.backward(engine, loss) if waves is not None else engine.backward(loss)
        backward += clock.lap()
        losses.append(float(loss.detach().float()))
        if i < len(batches) - 1:
            engine.step()  # a micro-step: DeepSpeed updates only at the boundary
    return losses, forward, backward


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["stock", "memstrata"], required=True)
    ap.add_argument("--preset", default="gpt-tiny")
    ap.add_argument("--arch-json", default="", help="a ModelArchitecture as JSON, instead of --preset")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--profile", default="tuned", choices=["literal", "default", "tuned"])
    ap.add_argument("--swap-dir", required=True)
    ap.add_argument("--nvme", default="", help="comma-separated namespaces for memstrata")
    ap.add_argument("--swap-json", default="", help="extra SwapSettings fields as JSON")
    ap.add_argument("--sub-group-size", type=int, default=0,
                    help="ZeRO-3 sub_group_size instead of the profile's (memstrata's plan-driven runs pass its own)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--torch-adam", action="store_true",
                    help="torch.optim.AdamW instead of DeepSpeedCPUAdam (where the cpu_adam op is not built)")
    ap.add_argument("--pause-at-step", type=int, default=0, help="write --out, then sleep inside this step")
    ap.add_argument("--param-device", default="nvme", choices=["nvme", "cpu"], help="offload_param.device")
    ap.add_argument("--optim-device", default="nvme", choices=["nvme", "cpu"], help="offload_optimizer.device")
    ap.add_argument("--zero-init", action="store_true",
                    help="build the model under zero.Init in the training dtype (memstrata: into its swap layer), "
                         "as a real run does, instead of whole in fp32 on the host first")
    ap.add_argument("--diskstats", default="",
                    help="comma-separated block devices whose /proc/diskstats bytes are recorded at every step")
    ap.add_argument("--gpu", action="store_true", help="run as on a GPU node (see the module doc); implies --zero-init "
                                                       "and --checkpointing")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing (memstrata: its offload; stock: torch's checkpoint)")
    ap.add_argument("--accumulation", type=int, default=1,
                    help="micro-batches of --batch per step (gradient accumulation); above 1 every engine takes "
                         "its loss chunk by chunk (memstrata.runtime.train.model.loss), as the runtime does")
    ap.add_argument("--layer-major", action="store_true",
                    help="memstrata: run the step's micro-batches layer-major (memstrata.runtime.train.model."
                         "layermajor), as the runtime does where weights are on NVMe; implies --checkpointing")
    args = ap.parse_args(argv)
    if args.layer_major:
        args.checkpointing = args.zero_init = True
    if args.gpu:
        args.zero_init = args.checkpointing = True

    # Told, not defaulted: an inherited value must not put a GPU run's DeepSpeed on the CPU or the reverse.
    os.environ["DS_ACCELERATOR"] = "cuda" if args.gpu else "cpu"
    for k, v in LONE_RANK.items():
        os.environ.setdefault(k, v)
    import logging

    import torch

    import deepspeed
    from memstrata.api.architecture import PRESETS
    from memstrata.runtime.train.model.hfmodel import random_model

    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from memstrata.runtime.train.observe.device import PhaseClock, hbm_peak_bytes, synchronizer

    torch.set_num_threads(os.cpu_count() or 1)
    mem = PhaseMemory()
    mem.start()
    device = torch.device("cuda", 0) if args.gpu else torch.device("cpu")
    if args.gpu:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if args.gpu else "gloo", verbose=False)
    from memstrata.api.architecture import ModelArchitecture

    arch = ModelArchitecture.model_validate_json(args.arch_json) if args.arch_json else PRESETS[args.preset]
    cfg = ds_config(arch, swap_dir=args.swap_dir, batch=args.batch, precision=args.precision, profile=args.profile,
                    param_device=args.param_device, optim_device=args.optim_device, pin=args.gpu)
    if args.sub_group_size:
        cfg["zero_optimization"]["sub_group_size"] = args.sub_group_size
    from memstrata.runtime.train.dsconfig import batch_config

    cfg.update(batch_config(args.batch, args.accumulation, 1, args.layer_major))
    Path(args.swap_dir).mkdir(parents=True, exist_ok=True)
    disks = [d for d in args.diskstats.split(",") if d]
    io_marks = [snapshot(disks)] if disks else []
    swap: dict[str, Any] = json.loads(args.swap_json) if args.swap_json else {}
    if args.nvme:
        swap["nvme"] = args.nvme.split(",")
    built = None
    t_build = time.perf_counter()
    if args.zero_init:
        built = build_zero3(arch, cfg, args, swap)
        model = built[0]
    else:
        model = random_model(arch, args.seq, args.seed)
    init_kw: dict[str, Any] = {"model": model, "model_parameters": model.parameters(), "config": cfg}
    if args.torch_adam:
        opt_params = cfg.pop("optimizer")["params"]
        cfg["zero_force_ds_cpu_optimizer"] = False
        init_kw["optimizer"] = torch.optim.AdamW(model.parameters(), lr=opt_params["lr"],
                                                 betas=tuple(opt_params["betas"]), eps=opt_params["eps"],
                                                 weight_decay=opt_params["weight_decay"])
        del init_kw["model_parameters"]
    if args.accumulation > 1:
        from memstrata.runtime.train.model.loss import install_chunked_loss

        install_chunked_loss(model, args.batch * args.seq)
    params = arch.parameters() if args.zero_init else sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"engine": args.engine, "preset": args.preset, "params": params, "config": cfg,
                           "losses": [], "step_seconds": [], "phases": {"forward": [], "backward": [], "update": []},
                           "zero_init": args.zero_init, "gpu": args.gpu, "checkpointing": args.checkpointing,
                           "accumulation": args.accumulation, "layer_major": args.layer_major}
    t0 = t_build if args.zero_init else time.perf_counter()  # under zero.Init, building is part of init
    if args.engine == "stock":
        engine, _, _, _ = deepspeed.initialize(**init_kw)
    elif built is not None:
        from memstrata.runtime.swap.integration import initialize as initialize_with_layer

        engine, _, _, _ = initialize_with_layer(**init_kw, layer=built[1])
    else:
        from memstrata.runtime import initialize

        engine, _, _, _ = initialize(**init_kw, swap=swap)
    out["init_seconds"] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed)
    vocab = min(arch.vocab, 256)
    layer = getattr(engine, "memstrata", None)
    if layer is not None:  # what init moved, so step 1's bytes are its own
        out["nvme_by_kind_init"] = {k: list(v) for k, v in layer.counters.by_kind.items()}
    clock = PhaseClock(synchronizer(device))
    waves = None
    if args.layer_major:
        from memstrata.runtime.train.model.layermajor import LayerMajor

        waves = LayerMajor.install(engine, args.accumulation)
    for step in range(1, args.steps + 1):
        micro = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
                 for _ in range(args.accumulation)]
        if disks:
            io_marks.append(snapshot(disks))
        s0 = clock.start()
        losses, forward, backward = micro_steps(engine, micro, waves, clock, mem)
        s1, s2 = s0 + forward, s0 + forward + backward
        mem.phase = "update"
        if args.pause_at_step == step:
            out["paused"] = True
            if layer is not None:
                out["swap"] = layer.status().wire()
            Path(args.out).write_text(json.dumps(out))
            time.sleep(3600)  # the test kills us here, mid-step, with I/O state live
        engine.step()
        s3 = s2 + clock.lap()
        out["losses"].append(sum(losses) / len(losses))
        out["phases"]["forward"].append(s1 - s0)
        out["phases"]["backward"].append(s2 - s1)
        out["phases"]["update"].append(s3 - s2)
        out["step_seconds"].append(s3 - s0)
        if layer is not None:  # cumulative, so a test can see hits per step
            out.setdefault("cache_hits", []).append(layer.cache_hits)
            # cumulative NVMe bytes per swapper kind ('param', 'optimizer'): {kind: [written, read]}
            out.setdefault("nvme_by_kind", []).append({k: list(v) for k, v in layer.counters.by_kind.items()})
        if step == 1:
            out["time_to_first_step"] = time.perf_counter() - t0
    out["rss_peak_by_phase"] = dict(mem.peaks)
    if args.gpu:
        out["hbm_peak_bytes"] = hbm_peak_bytes(device)
        out["gpu"] = torch.cuda.get_device_name(device)
    if disks:
        io_marks.append(snapshot(disks))
        # [init (build + initialize), step 1, ..., step N]: {device: [bytes read, bytes written]} each
        out["diskstats"] = {"devices": disks, "init": deltas(io_marks[0], io_marks[1]),
                            "steps": [deltas(a, b) for a, b in zip(io_marks[1:-1], io_marks[2:])]}
    if layer is not None:
        out["swap"] = layer.status().wire()
        out["overflow_checks"] = layer.overflow_checks
        out["checksums_verified"] = len(layer.checksums or {})
        layer.close()
    Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
