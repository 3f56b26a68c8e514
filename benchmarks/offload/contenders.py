"""One contender at one DRAM cap: what it runs (memstrata: what the planner says for that cap) and its run,
in its own process tree inside its own capped cgroup (record.run_watched + memcap.DramCap.preexec).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent)]

from budget import spread, step_io  # noqa: E402
from memcap import DramCap  # noqa: E402
from record import run_watched  # noqa: E402

HARNESS = HERE / "harness.py"
LOOP_BYTES = 64 << 30  # sparse: only what memstrata writes is allocated
# name: (harness profile, offload_param device, offload_optimizer device)
STOCK_PROFILES = {"stock-default": ("default", "nvme", "nvme"), "stock-tuned": ("tuned", "nvme", "nvme"),
                  "stock-cpu": ("tuned", "cpu", "cpu")}
# memstrata with the delayed update a job asks for by name (spec.training.update: delayed; the planner counts its
# shadows): each update beside the next step's forward and backward.
DELAYED = "memstrata-delayed"
CONTENDERS = ("memstrata", DELAYED, *STOCK_PROFILES)
# memstrata with each update beside the next forward whatever the device (SwapSettings.overlap_update true; by
# default only beside an accelerator's forward) and with each in place (false): benchmarks/offload/overlap.py
# compares the two. Not among CONTENDERS.
BESIDE, IN_PLACE = "memstrata-beside", "memstrata-in-place"
# memstrata's flavours: what each passes to memstrata_plan.
MEMSTRATA: dict[str, dict[str, Any]] = {"memstrata": {}, DELAYED: {"delayed": True}, BESIDE: {"overlap": True},
                                        IN_PLACE: {"overlap": False}}


def job_shape(arch: Any, seq: int, batch: int, engine: str, gpu: bool = False, delayed: bool = False) -> Any:
    from memstrata.plan.accounting import JobShape

    # On the CPU the harness runs without activation checkpointing, so the planner must not assume it; with --gpu
    # it runs with it, as a GPU node does.
    return JobShape(model=arch, sequence_length=seq, micro_batch=batch, precision="bf16", gpus=int(gpu),
                    engine=engine, activation_checkpointing=gpu, delayed_update=delayed)


def node(scratch: Path, gpu: bool) -> Any:
    """This machine as the planner sees it (with its GPUs as torch sees them, for --gpu)."""
    from memstrata.node.local import local_inventory

    if not gpu:
        return local_inventory(scratch)
    from memstrata.runtime.train.local import torch_gpus

    return local_inventory(scratch, gpus=torch_gpus)


def planned_base(arch: Any, seq: int, batch: int, gpu: bool = False) -> int:
    """Host bytes of a run that are not offloaded state, as the planner counts them: on the CPU the working set and
    the build; on a GPU the build and memstrata's activation pool (the working set is on the device)."""
    from memstrata.plan.accounting import build_transient, checkpoint_bytes, working_set

    job = job_shape(arch, seq, batch, "memstrata", gpu)
    return (checkpoint_bytes(job) if gpu else working_set(job)) + build_transient(job)


def stock_cpu_bytes(arch: Any, seq: int, batch: int, scratch: Path, gpu: bool = False) -> int:
    """DRAM the planner says stock DeepSpeed with everything offloaded to the CPU needs (no NVMe at all)."""
    from memstrata.api.finetunejob import MemoryPolicy
    from memstrata.plan.assignment import plan_for_node

    plan = plan_for_node(job_shape(arch, seq, batch, "deepspeed", gpu), node(scratch, gpu),
                         MemoryPolicy(engine="deepspeed", nvme_namespaces=0))
    return plan.bytes_on("dram")


def memstrata_plan(arch: Any, seq: int, batch: int, scratch: Path, budget: int, work: Path, loop: str,
                   gpu: bool = False, overlap: bool | None = None, delayed: bool = False
                   ) -> tuple[dict[str, Any], list[str]]:
    """(what the run records about its plan, the harness arguments that run it) for a DRAM budget."""
    from memstrata.api.finetunejob import MemoryPolicy
    from memstrata.plan.assignment import plan_for_node
    from memstrata.runtime.swap.stratamap import swap_settings
    from memstrata.runtime.train.dsconfig import offload_devices

    plan = plan_for_node(job_shape(arch, seq, batch, "memstrata", gpu, delayed), node(scratch, gpu),
                         MemoryPolicy(engine="memstrata", dram_budget=budget))
    # As in a pod: the device plugin grants a namespace only to a plan that puts something on NVMe.
    env = {"MEMSTRATA_NVME_DEVICES": loop} if plan.bytes_on("nvme") else {}
    settings = swap_settings(plan, arch, job="bench", run_dir=work, env=env).settings
    settings = settings.model_copy(update={"overlap_update": overlap})
    param_dev, optim_dev = offload_devices(plan)
    record = {"dram_budget_bytes": budget, "feasible": plan.feasible,
              "shortfalls": [s.message for s in plan.shortfalls],
              "bytes_on": {s: plan.bytes_on(s) for s in ("dram", "nvme")},
              "categories": {c.category: {"dram": c.on("dram"), "nvme": c.on("nvme")} for c in plan.categories},
              "offload_devices": [param_dev, optim_dev], "swap_settings": settings.model_dump(mode="json")}
    from memstrata.plan.accounting import memstrata_subgroup_elements

    args = ["--engine", "memstrata", "--profile", "tuned", "--param-device", param_dev, "--optim-device", optim_dev,
            "--sub-group-size", str(plan.sub_group_elements or memstrata_subgroup_elements(arch)),
            "--swap-json", json.dumps(settings.model_dump(mode="json"))]
    return record, args


def attach_loop(work: Path) -> str:
    img = work / "ns0.img"
    with open(img, "wb") as f:
        f.truncate(LOOP_BYTES)
    return subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(img)], check=True, capture_output=True,
                          text=True).stdout.strip()


def run_contender(contender: str, *, arch_name: str, arch: Any, seq: int, batch: int, warmup: int, measured: int,
                  cap: dict[str, Any], base: int, scratch: Path, backing: str, timeout: float,
                  gpu: bool = False) -> dict[str, Any]:
    """Run one contender under `cap` and return its record (ok, OOM, step spread, per-step I/O, memory)."""
    work = Path(tempfile.mkdtemp(prefix=f"{arch_name}-k{cap['k']}-{contender}-", dir=scratch))
    out = work / "result.json"
    loop = None
    rec: dict[str, Any] = {"contender": contender, "ok": False}
    try:
        common = ["--preset", arch_name, "--seq", str(seq), "--batch", str(batch), "--steps", str(warmup + measured),
                  "--zero-init", "--precision", "bf16", "--swap-dir", str(work / "swap"), "--out", str(out),
                  *(["--gpu"] if gpu else [])]
        devices = [backing]
        if contender in MEMSTRATA:
            loop = attach_loop(work)
            devices.append(Path(loop).name)
            try:
                rec["plan"], extra = memstrata_plan(arch, seq, batch, scratch, cap["bytes"] - base, work, loop, gpu,
                                                    **MEMSTRATA[contender])
            except ValueError as exc:  # the planner or stratamap refused: that is the result at this cap
                rec["error"] = f"no plan: {exc}"
                return rec
            if not rec["plan"]["feasible"]:  # as the operator would: an infeasible plan is never scheduled
                rec.update(refused=True, error="planner: the cap cannot hold the job: "
                                               + "; ".join(rec["plan"]["shortfalls"]))
                return rec
        else:
            profile, pdev, odev = STOCK_PROFILES[contender]
            extra = ["--engine", "stock", "--profile", profile, "--param-device", pdev, "--optim-device", odev]
        cmd = [sys.executable, str(HARNESS), *common, *extra, "--diskstats", ",".join(devices)]
        dram, why = DramCap.open(f"{arch_name}-{contender}", cap["bytes"])
        print(f"== {arch_name} k={cap['k']} ({cap['bytes'] / 2**30:.2f} GiB) {contender}", flush=True)
        try:
            w = run_watched(cmd, REPO, timeout, preexec=dram.preexec if dram else None)
            rec.update(wall_seconds=round(w.wall_seconds, 2), peak_rss_bytes=w.tree_peak_rss_bytes,
                       cgroup=({"version": dram.version, "limit_bytes": dram.limit_bytes,
                                "peak_bytes": dram.peak_bytes()} if dram else {"enforced": False, "why": why}),
                       oom_killed=bool(dram and dram.oom_killed()))
        finally:
            if dram:
                dram.close()
        rec["command"] = " ".join(cmd)
        if w.returncode != 0 or not out.exists():
            rec["error"] = ("killed by the OOM killer under the cap" if rec["oom_killed"] else w.error())
            return rec
        rec.update(_measure(json.loads(out.read_text()), warmup, devices))
        rec["ok"] = True
        return rec
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({k: v for k, v in rec.items() if k in ("contender", "ok", "error", "step", "peak_rss_bytes",
                                                                "oom_killed")}), flush=True)


def _measure(data: dict[str, Any], warmup: int, devices: list[str]) -> dict[str, Any]:
    """A finished harness's record: step spread and phase medians over the measured steps, per-step I/O."""
    import statistics

    later = slice(warmup, None)
    disk = data.get("diskstats") or {}
    steps = disk.get("steps", [])
    io = {d: step_io(steps, d, warmup) for d in devices}
    kinds = data.get("nvme_by_kind")  # memstrata: cumulative {kind: [written, read]} after each step
    marks = [data.get("nvme_by_kind_init") or {}, *kinds] if kinds else []
    param = [b.get("param", [0, 0])[1] - a.get("param", [0, 0])[1] for a, b in zip(marks, marks[1:])][warmup:]
    return {"step": spread(data["step_seconds"][later]), "step_seconds_all": data["step_seconds"],
            "phases": {k: statistics.median(v[later]) for k, v in data["phases"].items()},
            "init_seconds": data["init_seconds"], "time_to_first_step": data.get("time_to_first_step"),
            "losses": data["losses"], "params": data["params"], "rss_peak_by_phase": data.get("rss_peak_by_phase"),
            "io": {d: v for d, v in io.items() if v is not None}, "init_io": disk.get("init"),
            "param_read_bytes": int(statistics.median(param)) if param else None,
            "swap": data.get("swap"), "config": data.get("config"), "hbm_peak_bytes": data.get("hbm_peak_bytes")}
