"""One training attempt of the checkpoint benchmark, in its own process (DeepSpeed's state is per process):

    python benchmarks/checkpoint/worker.py --job JOB.yaml --scratch DIR --out result.json [--resume]

Without --resume: `FineTuneRecipe.setup()` and `train()` for the job's steps, checkpoints as its
spec.checkpoint says. With --resume: a fresh process that resumes from the newest checkpoint (the load is
timed) and trains the steps left. Either way it writes, per phase (init, resume, eval, step-N, checkpoint),
the exact peak RSS of this process: at every phase change the kernel's high-water mark (VmHWM) is read and
reset (`5 > /proc/self/clear_refs`), so a spike between samples is not missed; a thread also samples RSS
every 2 ms as a cross-check. The checkpoint's own calls are wrapped from outside (nothing in the runtime is
changed): the sub-group reads (swap-ins), the per-file writes and their RSS. A job without spec.checkpoint is
the control run (the same training, no checkpoint). --trim-after-save and --copy-resumed-tensors are
diagnostics for the two memory problems the benchmark found (README, Benchmarks).
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

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def mem() -> dict[str, int]:
    """This process's resident bytes by kind (anonymous, file-backed, shared) and locked bytes."""
    keys = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem", "VmLck:": "locked"}
    with open("/proc/self/status") as f:
        return {keys[p[0]]: int(p[1]) * 1024 for line in f if (p := line.split()) and p[0] in keys}


def hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class Phases:
    """Peak RSS per phase: VmHWM read and reset at each change, plus a 2 ms sampler."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.phase = "init"
        self.started = time.perf_counter()
        self.hwm: dict[str, int] = {}
        self.sampled: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.entry_rss: dict[str, int] = {}
        self.resettable = True
        self._reset()
        threading.Thread(target=self._sample, daemon=True, name="ckpt-bench-rss").start()

    def _reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.resettable = False  # then VmHWM is the peak so far, and only the samples are per phase

    def _sample(self) -> None:
        while True:
            value = rss()
            with self.lock:
                self.sampled[self.phase] = max(self.sampled.get(self.phase, 0), value)
            time.sleep(0.002)

    def enter(self, phase: str) -> str:
        """Close the current phase, open `phase`; returns the phase that was closed."""
        with self.lock:
            now = time.perf_counter()
            old = self.phase
            self.hwm[old] = max(self.hwm.get(old, 0), hwm())
            self.seconds[old] = self.seconds.get(old, 0.0) + now - self.started
            self.sampled[old] = max(self.sampled.get(old, 0), rss())
            self._reset()
            self.phase, self.started = phase, now
            self.entry_rss.setdefault(phase, rss())
            return old

    def report(self) -> dict[str, Any]:
        self.enter("done")
        peaks = {p: max(self.hwm.get(p, 0), self.sampled.get(p, 0)) for p in self.hwm if p != "done"}
        return {"peak_rss_bytes": peaks, "hwm_bytes": self.hwm, "sampled_bytes": self.sampled,
                "entry_rss_bytes": self.entry_rss, "seconds": self.seconds, "hwm_reset": self.resettable}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, required=True, help="the NVMe stratum: file-backed, on a disk")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--trim-after-save", action="store_true",
                    help="diagnostic: give memstrata's idle optimizer-pool regions back right after each checkpoint "
                         "(what the optimizer step does after an update)")
    ap.add_argument("--copy-resumed-tensors", action="store_true",
                    help="diagnostic: hand the resume a copy of each tensor read from the checkpoint instead of "
                         "safetensors' view of its file mapping")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    phases = Phases()
    t_start = time.perf_counter()

    import torch

    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.checkpoints import checkpoint as ckmod
    from memstrata.runtime.train.checkpoints import ckptstore
    from memstrata.runtime.train.recipe import FineTuneRecipe

    torch.set_num_threads(os.cpu_count() or 1)
    job = load_job(args.job)
    plan = plan_job(job.spec, local_inventory(args.scratch))
    recipe = FineTuneRecipe(job, plan, args.scratch, resume=args.resume)
    ck = recipe.checkpointer  # None: a control run, the same job without spec.checkpoint
    out: dict[str, Any] = {"engine": recipe.engine_name, "preset": job.spec.model.preset, "resume": args.resume,
                           "parameters": plan.parameters,
                           "plan": {c.category: {"dram": c.on("dram"), "nvme": c.on("nvme")} for c in plan.categories},
                           "steps": [], "checkpoints": [], "files": [], "reads": []}

    # --- instrumentation, from outside ---------------------------------------------------------------------
    saving = {"on": False}
    real_write = ckptstore.write_tensors

    def timed_write(path: Path, tensors: dict[str, Any]) -> Any:
        before, t0 = rss(), time.perf_counter()
        digest = real_write(path, tensors)
        if saving["on"]:
            out["files"].append({"file": path.name, "bytes": digest.bytes, "seconds": time.perf_counter() - t0,
                                 "rss_before": before, "rss_after": rss(), "mem_after": mem()})
        return digest

    ckptstore.write_tensors = timed_write  # checkpoint.py calls it as ckptstore.write_tensors
    real_read, real_release, real_fill = ckmod.SubGroups.read, ckmod.SubGroups.release, ckmod.SubGroups.write

    def timed_read(self: Any, i: int) -> Any:
        before, t0 = rss(), time.perf_counter()
        swapped = self.swapped(i)
        got = real_read(self, i)
        if saving["on"]:
            # The buffers the swap-in took (state, and any gradient buffer it filled), beside what is saved.
            swapper = getattr(self.zero, "optimizer_swapper", None)
            info = swapper._get_param_swap_info(self.zero.fp32_partitioned_groups_flat[i]) if swapped and swapper else None
            buffers = list(getattr(info, "swap_buffers", None) or [])
            out["reads"].append({"group": i, "swapped": swapped, "seconds": time.perf_counter() - t0,
                                 "rss_before": before, "rss_after": rss(),
                                 "tensor_bytes": sum(t.numel() * t.element_size() for t in got[0].values()),
                                 "swap_buffers": len(buffers),
                                 "swap_buffer_bytes": sum(b.numel() * b.element_size() for b in buffers)})
        return got

    def timed_release(self: Any, i: int) -> None:
        real_release(self, i)
        if saving["on"] and out["reads"]:
            out["reads"][-1]["rss_after_release"] = rss()
            out["reads"][-1]["mem_after_release"] = mem()

    def timed_fill(self: Any, i: int, tensors: Any, names: list[str], scalars: dict[str, Any]) -> None:
        before, t0 = rss(), time.perf_counter()
        if args.copy_resumed_tensors:
            real_fill(self, i, lambda name: tensors(name).clone(), names, scalars)
        else:
            real_fill(self, i, tensors, names, scalars)
        out.setdefault("fills", []).append({"group": i, "seconds": time.perf_counter() - t0, "rss_before": before,
                                            "rss_after": rss(), "mem_after": mem()})

    ckmod.SubGroups.read, ckmod.SubGroups.release, ckmod.SubGroups.write = timed_read, timed_release, timed_fill

    def save(engine: Any, **kw: Any) -> Any:
        previous = phases.enter("checkpoint")
        saving["on"] = True
        mem_before, t0 = mem(), time.perf_counter()
        try:
            status = real_save(engine, **kw)
        finally:
            saving["on"] = False
            seconds = time.perf_counter() - t0
            mem_after = mem()
            trimmed = None
            if args.trim_after_save and getattr(engine, "memstrata", None) is not None:
                trimmed = engine.memstrata.trim()
            phases.enter(previous)
        out["checkpoints"].append({"step": status.step, "path": status.path, "bytes": status.bytes,
                                   "seconds": status.seconds, "wall_seconds": seconds, "mem_before": mem_before,
                                   "mem_after": mem_after, "trimmed_bytes": trimmed, "mem_after_trim": mem()})
        return status

    def resume(engine: Any, found: Any) -> Any:
        previous = phases.enter("resume")
        out["resume_mem_before"] = mem()
        t0 = time.perf_counter()
        try:
            return real_resume(engine, found)
        finally:
            out["resume_seconds"] = time.perf_counter() - t0
            out["resume_mem_after"] = mem()
            with open("/proc/self/maps") as maps:
                out["checkpoint_files_mapped_after_resume"] = len(
                    {line.split()[-1] for line in maps if line.rstrip().endswith(".safetensors")})
            phases.enter(previous)

    if ck is not None:
        real_save, real_resume = ck.save, ck.resume
        ck.save, ck.resume = save, resume  # type: ignore[method-assign]
    real_evaluate = recipe.evaluate

    def evaluate() -> Any:
        previous = phases.enter("eval")
        try:
            return real_evaluate()
        finally:
            phases.enter(previous)

    recipe.evaluate = evaluate  # type: ignore[method-assign]

    # --- the run -------------------------------------------------------------------------------------------
    try:
        t0 = time.perf_counter()
        recipe.setup()
        out["setup_seconds"] = time.perf_counter() - t0
        zero = recipe.engine.optimizer  # type: ignore[union-attr]
        out["sub_group_numels"] = [int(n) for n in zero.fp16_partitioned_groups_flat_numel]
        out["sub_groups_swappable"] = [bool(zero._swappable_optimizer_subgroup(i))
                                       for i in range(len(zero.fp16_groups))]
        first = (recipe.resumed.step if recipe.resumed is not None else 0) + 1
        out["resumed_from_step"] = first - 1
        phases.enter(f"step-{first}")

        def on_step(s: Any) -> None:
            out["steps"].append({"step": s.step, "loss": s.loss, "loss_hex": float(s.loss).hex(),
                                 "seconds": s.seconds, "mem_after": mem()})
            phases.enter(f"step-{s.step + 1}")
            print(f"step {s.step} loss {s.loss:.4f} {s.seconds:.1f} s", file=sys.stderr, flush=True)

        recipe.train(on_step)
        phases.enter("teardown")
        layer = getattr(recipe.engine, "memstrata", None)
        if layer is not None:
            out["memstrata_cache_bytes"] = int(getattr(layer, "cache_bytes", 0))
    finally:
        recipe.cleanup()
    out["memory"] = phases.report()
    out["wall_seconds"] = time.perf_counter() - t_start
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
