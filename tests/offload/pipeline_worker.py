"""One memstrata gpt-tiny run that records what the pipelined optimizer update did, step by step.

    python pipeline_worker.py DEVICE SWAP_DIR OUT SWAP_JSON STEPS [sub-group=N] [skip-at=N] [fail-at=N] [param=cpu]
Writes OUT (JSON): losses, a digest of the final 16-bit weights, every I/O batch of the optimizer
swapper's handles as (role, start, end) with role read/write/sync, the Adam span of every sub-group,
prefetch hits and the optimizer pool's bytes in use vs the DRAM cache's after every step.
`skip-at=N`: step N's loss is scaled to inf: its gradient norm is not finite and ZeRO-3 skips the step
(the path an fp16 overflow takes, which this CPU's DeepSpeed cannot run).
`fail-at=N`: Adam of the second sub-group of step N raises; the step's current sub-group is released
as a caller that catches the error would, and the pool is measured again.
`param=cpu`: the 16-bit weights stay in DRAM (offload_param cpu) instead of going to NVMe; `param=none`: on the
accelerator. DS_ACCELERATOR (default cpu) names the accelerator.
`init-chunk=N`: the fp32 master is first written N elements at a time (memstrata.runtime.swap.optimizer.INIT_CHUNK).
`warmup=N`: DeepSpeed's WarmupLR over N steps, so the learning rate changes every step.
`fail-late=1`: the failing Adam first waits (up to 60 s) for the next forward to begin.
`hold-last=W[,W2]`: the last Adam of update W waits (up to `hold-seconds`, 60) for the next forward to begin;
whether it began is recorded (`held`).
`hold-first=W`, `hold-after=S`: the first Adam of update W waits for the next forward to begin, then S seconds
more (a delayed update then falls behind that step's backward); whether it began is recorded (`held`).
`ckpt-after=N`: right after step N's step(), memstrata's checkpoint reads every sub-group (`ckpt`: digest, seconds).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "offload"))


class InjectedFailure(RuntimeError):
    pass


def main() -> None:
    device, swap_dir, out, swap_json, steps = sys.argv[1:6]
    opts = dict(a.split("=", 1) for a in sys.argv[6:])
    overflow_at, fail_at = int(opts.get("skip-at", 0)), int(opts.get("fail-at", 0))
    from harness import LONE_RANK, ds_config

    for k, v in {**LONE_RANK, "DS_ACCELERATOR": "cpu"}.items():
        os.environ.setdefault(k, v)
    import torch
    import deepspeed

    from memstrata.api.architecture import PRESETS
    from memstrata.runtime import initialize
    from memstrata.runtime.train.model.hfmodel import random_model

    torch.manual_seed(0)
    arch = PRESETS["gpt-tiny"]
    model = random_model(arch, 32, 1234)
    Path(swap_dir).mkdir(parents=True, exist_ok=True)
    cfg = ds_config(arch, swap_dir=swap_dir, batch=2, precision="bf16", profile="tuned",
                    param_device=opts.get("param", "nvme"))
    if "warmup" in opts:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                           "warmup_num_steps": int(opts["warmup"])}}
    if "sub-group" in opts:  # smaller sub-groups: more of them to pipeline
        cfg["zero_optimization"]["sub_group_size"] = int(opts["sub-group"])
    swap: dict[str, Any] = {"nvme": [device], **json.loads(swap_json)}
    if "init-chunk" in opts:
        from memstrata.runtime.swap import optimizer as swap_optimizer

        swap_optimizer.INIT_CHUNK = int(opts["init-chunk"])
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg, swap=swap)
    layer, opt = engine.memstrata, engine.optimizer
    init_peak = layer.pool.peak_in_use
    swapper = opt.optimizer_swapper
    io: list[tuple[str, float, float]] = []
    ra = swapper.readahead
    roles = {id(h): "read" for h in ra._idle} | ({id(ra._writer): "write"} if ra._writer is not None else {})
    for h in layer.handles:
        if h.kind == "optimizer":
            role = roles.get(id(h), "sync")
            h.on_io = lambda _k, t0, t1, role=role: io.append((role, t0, t1))
    adam: list[tuple[float, float]] = []
    inner = opt._optimizer_step
    current_step, walks, held = [0], [0], []
    holds = set(opts.get("hold-last", "").split(","))
    forward_began = {step: threading.Event() for step in range(1, int(steps) + 2)}

    def timed(position: int, *args: Any, **kwargs: Any) -> Any:
        walks[0] += position == 0
        if walks[0] == fail_at and position == 1:
            if opts.get("fail-late"):  # after the next forward began: an update beside it fails there
                held.append(forward_began[walks[0] + 1].wait(60))
            raise InjectedFailure("injected")
        if str(walks[0]) in holds and position == len(opt.fp16_groups) - 1:
            held.append(forward_began[walks[0] + 1].wait(float(opts.get("hold-seconds", 60))))
        if str(walks[0]) == opts.get("hold-first") and position == 0:
            held.append(forward_began[walks[0] + 1].wait(60))
            time.sleep(float(opts.get("hold-after", 0)))
        t0 = time.monotonic()
        try:
            return inner(position, *args, **kwargs)
        finally:
            adam.append((t0, time.monotonic()))

    opt._optimizer_step = timed
    gen = torch.Generator().manual_seed(7)
    lrs: list[float] = []
    ckpt: dict[str, Any] = {}
    losses, hits, in_use, cache, skipped, locked = [], [], [], [], [], []
    failure: dict[str, Any] = {}
    for step in range(1, int(steps) + 1):
        current_step[0] = step
        ids = torch.randint(0, 200, (2, 32), generator=gen).to(engine.device)
        forward_began[step].set()
        at = "forward"  # an update beside the forward (memstrata.runtime.swap.overlap) raises in the next one
        try:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss * float("inf") if step == overflow_at else loss)
            at = "step"
            engine.step()
            if step == int(opts.get("ckpt-after", 0)):
                ckpt = checkpoint_digest(opt)
        except InjectedFailure as exc:
            walked = layer.subgroup_order.history[-1]
            swapper.release_swap_buffers(opt.fp32_partitioned_groups_flat[walked[-1]])
            failure = {"step": step, "walked": walked, "in_use": layer.pool.in_use, "cache": layer.cache_bytes,
                       "reads_in_flight": len(ra._reads), "at": at, "notes": getattr(exc, "__notes__", [])}
            break
        losses.append(float(loss.detach().float()))
        lrs.append(engine.get_lr()[0])
        hits.append(layer.prefetch_hits)
        in_use.append(layer.pool.in_use)
        cache.append(layer.cache_bytes)
        locked.append(layer.pool.locked_bytes)
        skipped.append(bool(getattr(opt, "overflow", False)))
    digest = hashlib.sha256()
    if not failure:
        for p in engine.module.parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                digest.update(p.detach().float().contiguous().numpy().tobytes())
    swappable = sum(1 for g in range(len(opt.fp16_groups)) if opt._swappable_optimizer_subgroup(g))
    Path(out).write_text(json.dumps({
        "losses": losses, "weights": digest.hexdigest(), "io": io, "adam": adam, "prefetch_hits": hits,
        "pool_in_use": in_use, "cache_bytes": cache, "skipped": skipped, "failure": failure,
        "swappable": swappable, "groups": len(opt.fp16_groups), "orders": layer.subgroup_order.history,
        "cache_hits": layer.cache_hits, "pool_locked": locked, "pool_peak": layer.pool.peak_in_use,
        "init_peak": init_peak,
        "sliced": sorted(layer.sliced.ids) if layer.sliced is not None else [],
        "slices": layer.sliced.slices_updated if layer.sliced is not None else 0,
        "numels": [int(n) for n in opt.fp16_partitioned_groups_flat_numel],
        "param_bytes": layer.counters.by_kind.get("param", [0, 0]),
        "status": layer.status().dram.wire(), "overlap": layer.status().update_overlap.wire(), "held": held, "ckpt": ckpt,
        "lrs": lrs,
    }))
    layer.close()


def checkpoint_digest(opt: Any) -> dict[str, Any]:
    """What memstrata's checkpoint reads of every sub-group (its master and moments, through ZeRO-3's own swap
    calls), digested, and how long that took."""
    from memstrata.runtime.train.checkpoints.engine_state import SubGroups

    t0, digest, groups = time.monotonic(), hashlib.sha256(), SubGroups(opt)
    for i in range(len(groups)):
        tensors, _ = groups.read(i)
        for name in sorted(tensors):
            digest.update(tensors[name].detach().float().contiguous().numpy().tobytes())
        groups.release(i)
    return {"digest": digest.hexdigest(), "seconds": time.monotonic() - t0}


if __name__ == "__main__":
    main()
