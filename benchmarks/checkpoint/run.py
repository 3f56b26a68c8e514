"""Checkpoints: memstrata's swap layer vs stock ZeRO-Infinity, same job, one run each.

    python benchmarks/checkpoint/run.py                          # gpt-125m and gpt-350m, both engines
    python benchmarks/checkpoint/run.py --models gpt-125m --steps 3 --every 2

Per (model, engine), two processes of benchmarks/checkpoint/worker.py (DeepSpeed's state is per process):
the first trains `--steps` steps (synthetic data, bf16, micro-batch 1, no GPU) with a checkpoint every
`--every` steps, the plan being memstrata.plan.plan_job's for this machine with a DRAM budget that sends the
weights and the optimizer state to the (file-backed) NVMe stratum, so the checkpoint streams every sub-group
from NVMe (memstrata: its extents or its DRAM cache; stock: its swap files); the second resumes from that
checkpoint (the load is timed) and trains the steps left, whose losses must equal the first run's bit for bit.

Measured: the checkpoint's write time, bytes, MB/s and files; the peak RSS of the training process during
the steps vs during the checkpoint write (exact per phase: the worker resets the kernel's VmHWM at each
phase change); the time to resume. The check issue 14 asks for: a checkpoint must not raise the job's peak
by more than its staging buffers, one optimizer sub-group (fp32 master weights and both Adam moments):
peak(checkpoint) - peak(training steps) <= the largest sub-group's bytes.
Writes benchmarks/results/checkpoint.json, checkpoint.md and checkpoint.png (checkpoint_plot.py, where matplotlib
imports).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "benchmarks" / "checkpoint" / "worker.py"
RESULTS = REPO / "benchmarks" / "results"
sys.path[:0] = [str(REPO / "runtime"), str(REPO / "operator"), str(REPO / "benchmarks"), str(WORKER.parent)]
from record import machine, run_watched, write_results  # noqa: E402
from checkpoint_plot import plot  # noqa: E402

# The DRAM budgets of benchmarks/plan/memory.py: the weights and the optimizer state go to the NVMe stratum
# (memstrata keeps part of the fp32 master weights in its DRAM cache), as a job that needs offloading has.
DRAM_BUDGETS = {"gpt-tiny": "8Mi", "gpt-125m": "600Mi", "gpt-350m": "1500Mi"}
ENGINES = ("memstrata", "deepspeed")
MIB, GIB = 1 << 20, 1 << 30


def job_yaml(preset: str, engine: str, *, seq: int, steps: int, every: int, checkpoints: Path | None) -> str:
    """The benchmark's FineTuneJob; `checkpoints` None: the control run, the same job without spec.checkpoint."""
    ck = f"  checkpoint: {{path: {checkpoints}, everySteps: {every}, keep: 1}}\n" if checkpoints else ""
    return f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: ckpt-{preset}-{engine}}}
spec:
  model: {{preset: {preset}}}
  dataset: {{synthetic: arithmetic}}
  training: {{sequenceLength: {seq}, microBatch: 1, steps: {steps}, precision: bf16, seed: 1234}}
  resources: {{gpus: 0}}
  memory: {{engine: {engine}, dramBudget: {DRAM_BUDGETS[preset]}}}
""" + ck


def dir_files(path: Path) -> list[dict[str, Any]]:
    return [{"name": p.name, "bytes": p.stat().st_size} for p in sorted(path.iterdir()) if p.is_file()]


def worker(job: Path, nvme: Path, out: Path, *, resume: bool, timeout: float, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(WORKER), "--job", str(job), "--scratch", str(nvme), "--out", str(out), *extra]
    if resume:
        cmd.append("--resume")
    run = run_watched(cmd, REPO, timeout)
    if run.returncode != 0 or not out.exists():
        return {"ok": False, "error": run.error(), "wall_seconds": run.wall_seconds}
    return {"ok": True, **json.loads(out.read_text()), "process_wall_seconds": run.wall_seconds,
            "tree_peak_rss_bytes": run.tree_peak_rss_bytes}


def run_pair(preset: str, engine: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Control (no checkpoint), then train with a checkpoint, then resume from it; each its own process."""
    work = scratch / f"{preset}-{engine}"
    shutil.rmtree(work, ignore_errors=True)
    nvme, checkpoints = work / "nvme", work / "checkpoints"
    nvme.mkdir(parents=True)
    job = work / "job.yaml"
    job.write_text(job_yaml(preset, engine, seq=args.seq, steps=args.steps, every=args.every,
                            checkpoints=checkpoints))
    extra = list(args.worker_args)
    res: dict[str, Any] = {"model": preset, "engine": engine, "worker_args": extra}
    try:
        if args.control:
            control = work / "control.yaml"
            control.write_text(job_yaml(preset, engine, seq=args.seq, steps=args.steps, every=args.every,
                                        checkpoints=None))
            print(f"== {preset} {engine}: control, {args.steps} steps without a checkpoint", flush=True)
            res["control"] = worker(control, nvme, work / "control.json", resume=False, timeout=args.timeout,
                                    extra=extra)
            if not res["control"]["ok"]:
                print(res["control"]["error"], flush=True)
        print(f"== {preset} {engine}: train {args.steps} steps, a checkpoint every {args.every}", flush=True)
        res["train"] = train = worker(job, nvme, work / "train.json", resume=False, timeout=args.timeout,
                                      extra=extra)
        if not train["ok"]:
            print(train["error"], flush=True)
            return res
        latest = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step-"))
        res["checkpoint_files"] = dir_files(latest[-1]) if latest else []
        print(f"== {preset} {engine}: resume from {latest[-1].name if latest else '-'}", flush=True)
        res["resume"] = worker(job, nvme, work / "resume.json", resume=True, timeout=args.timeout, extra=extra)
        if not res["resume"]["ok"]:
            print(res["resume"]["error"], flush=True)
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)  # up to ~4 GiB of checkpoint and the swap files


def _step_peaks(run: dict[str, Any], steps: int) -> dict[int, int]:
    return {int(k.split("-")[1]): v for k, v in run["memory"]["peak_rss_bytes"].items()
            if k.startswith("step-") and int(k.split("-")[1]) <= steps}


def _job_peak(run: dict[str, Any]) -> int:
    """The run's peak RSS over every phase but the teardown (cleanup after training)."""
    return max(v for k, v in run["memory"]["peak_rss_bytes"].items() if k != "teardown")


def summarize(r: dict[str, Any], steps: int) -> dict[str, Any]:
    """The figures the tables show, from one (model, engine) record."""
    t = r.get("train") or {}
    if not t.get("ok"):
        return {"ok": False, "error": t.get("error", "not run")}
    ck = t["checkpoints"][-1]
    peaks = t["memory"]["peak_rss_bytes"]
    entry = t["memory"]["entry_rss_bytes"]
    step_peaks = _step_peaks(t, steps)
    before = max(v for k, v in step_peaks.items() if k <= ck["step"])
    numels = t["sub_group_numels"]
    state_bytes = [x["tensor_bytes"] for x in t["reads"]]
    largest = max(state_bytes) if state_bytes else max(numels) * 12
    files = r.get("checkpoint_files", [])
    after_ckpt = [x for x in t["checkpoints"] if x["step"] == ck["step"]][0]
    out: dict[str, Any] = {
        "ok": True,
        "parameters": t["parameters"],
        "checkpoint_step": ck["step"],
        "checkpoint_seconds": ck["seconds"],
        "checkpoint_bytes": ck["bytes"],
        "checkpoint_mb_per_s": ck["bytes"] / ck["seconds"] / 1e6 if ck["seconds"] else None,
        "checkpoint_files": len(files),
        "checkpoint_group_files": sum(1 for f in files if f["name"].endswith(".safetensors")),
        "sub_groups": len(numels),
        "sub_groups_on_nvme": sum(t["sub_groups_swappable"]),
        "sub_group_numels": numels,
        "largest_sub_group_bytes": largest,
        "swap_in_seconds": sum(x["seconds"] for x in t["reads"]),
        "file_write_seconds": sum(x["seconds"] for x in t["files"]),
        "step_seconds": statistics.median(s["seconds"] for s in t["steps"][1:] or t["steps"]),
        "peak_rss_by_step": {str(k): v for k, v in sorted(step_peaks.items())},
        "peak_rss_init": peaks.get("init"),
        # The check of issue 14: the checkpoint write against the training steps up to it.
        "peak_rss_training": before,
        "peak_rss_checkpoint": peaks["checkpoint"],
        "checkpoint_raise_bytes": peaks["checkpoint"] - before,
        "rss_entering_checkpoint": entry.get("checkpoint"),
        "checkpoint_growth_bytes": peaks["checkpoint"] - entry.get("checkpoint", peaks["checkpoint"]),
        "locked_bytes_left_by_checkpoint": after_ckpt["mem_after"]["locked"] - after_ckpt["mem_before"]["locked"],
        "rss_left_by_checkpoint": (after_ckpt["mem_after"]["anon"] + after_ckpt["mem_after"]["file"]
                                   - after_ckpt["mem_before"]["anon"] - after_ckpt["mem_before"]["file"]),
        "job_peak_rss": _job_peak(t),
        "tree_peak_rss_bytes": t.get("tree_peak_rss_bytes"),
        "train_wall_seconds": t["process_wall_seconds"],
    }
    out["staging_check_ok"] = out["checkpoint_raise_bytes"] <= largest
    c = r.get("control") or {}
    if c.get("ok"):
        cp = _step_peaks(c, steps)
        out.update(control_job_peak_rss=_job_peak(c), control_peak_rss_by_step={str(k): v for k, v in sorted(cp.items())},
                   control_wall_seconds=c["process_wall_seconds"])
        out["job_peak_raise_bytes"] = out["job_peak_rss"] - out["control_job_peak_rss"]
        out["job_peak_check_ok"] = out["job_peak_raise_bytes"] <= largest
        nxt = ck["step"] + 1
        if nxt in step_peaks and nxt in cp:  # the step after the checkpoint, against the same step unchecked
            out["next_step_peak_raise_bytes"] = step_peaks[nxt] - cp[nxt]
    rs = r.get("resume") or {}
    if rs.get("ok"):
        want = {s["step"]: s["loss_hex"] for s in t["steps"]}
        got = {s["step"]: s["loss_hex"] for s in rs["steps"]}
        rsp = _step_peaks(rs, steps)
        out.update(resume_seconds=rs["resume_seconds"], resume_setup_seconds=rs["setup_seconds"],
                   resume_mb_per_s=ck["bytes"] / rs["resume_seconds"] / 1e6 if rs["resume_seconds"] else None,
                   peak_rss_resume=rs["memory"]["peak_rss_bytes"].get("resume"), resumed_from_step=rs["resumed_from_step"],
                   resumed_losses_identical=bool(got) and all(want.get(k) == v for k, v in got.items()),
                   resumed_step_peak_rss=max(rsp.values()) if rsp else None,
                   resumed_job_peak_rss=_job_peak(rs),
                   # What the resume leaves resident: file-backed pages of checkpoint files still mapped.
                   resume_file_rss_left_bytes=rs["resume_mem_after"]["file"] - rs["resume_mem_before"]["file"],
                   checkpoint_files_mapped_after_resume=rs.get("checkpoint_files_mapped_after_resume"),
                   resume_wall_seconds=rs["process_wall_seconds"])
        same = [step_peaks[k] for k in rsp if k in step_peaks]
        if same:  # the same steps, uninterrupted
            out["resumed_step_peak_raise_bytes"] = max(rsp.values()) - max(same)
    else:
        out["resume_error"] = rs.get("error", "not run")
    return out


RATIOS = {  # memstrata / stock, for these fields
    "checkpoint_seconds": "checkpoint_time_ratio", "checkpoint_mb_per_s": "checkpoint_throughput_ratio",
    "checkpoint_bytes": "checkpoint_bytes_ratio", "peak_rss_training": "peak_rss_training_ratio",
    "peak_rss_checkpoint": "peak_rss_checkpoint_ratio", "job_peak_rss": "job_peak_rss_ratio",
    "resume_seconds": "resume_time_ratio", "resumed_step_peak_rss": "resumed_step_peak_rss_ratio",
    "step_seconds": "step_time_ratio",
}


def ratios(m: dict[str, Any], s: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, name in RATIOS.items():
        a, b = m.get(key), s.get(key)
        out[name] = round(a / b, 3) if a is not None and b else None
    return out


def _f(v: Any, scale: float = GIB, fmt: str = "{:.2f}") -> str:
    return fmt.format(v / scale) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _ok(v: Any) -> str:
    return "-" if v is None else ("yes" if v else "**no**")


def render(results: dict[str, Any], png: str | None = None) -> str:
    """The Markdown tables; `png`, the plot's file name beside it, is linked above them."""
    a = results["args"]
    lines = [f"# Checkpoints: memstrata vs stock ZeRO-Infinity (seq {a['seq']}, micro-batch 1, {a['steps']} steps, "
             f"a checkpoint after step {a['every']}, bf16, CPU)", "",
             *([f"![checkpoint time, throughput and peak RSS: memstrata vs stock]({png})", ""] if png else []),
             "Writing and resuming:", "",
             "| model | engine | sub-groups (on NVMe) | ckpt s | ckpt GiB | MB/s | files | swap-in s | file write s | "
             "step s | resume s | resume MB/s | resumed losses bit-identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, m in results["models"].items():
        for engine in ENGINES:
            s = m.get(engine) or {}
            if not s.get("ok"):
                err = (s.get("error") or "").splitlines()[-1:] or [""]
                lines.append(f"| {model} | {engine} | failed: `{err[0][:120]}` |" + " |" * 10)
                continue
            lines.append(
                f"| {model} | {engine} | {s['sub_groups']} ({s['sub_groups_on_nvme']}) | {s['checkpoint_seconds']:.2f} | "
                f"{_f(s['checkpoint_bytes'])} | {s['checkpoint_mb_per_s']:.0f} | {s['checkpoint_files']} | "
                f"{s['swap_in_seconds']:.2f} | {s['file_write_seconds']:.2f} | {s['step_seconds']:.1f} | "
                f"{_f(s.get('resume_seconds'), 1)} | {_f(s.get('resume_mb_per_s'), 1, '{:.0f}')} | "
                f"{_ok(s.get('resumed_losses_identical'))} |")
        r = m.get("ratios")
        if r:
            lines.append(f"| {model} | **memstrata / stock** | | {r['checkpoint_time_ratio']} | "
                         f"{r['checkpoint_bytes_ratio']} | {r['checkpoint_throughput_ratio']} | | | | "
                         f"{r['step_time_ratio']} | {r['resume_time_ratio']} | | |")
    lines += ["", "Peak RSS of the training process, GiB (differences in MiB); one sub-group = its fp32 master "
              "weights and both Adam moments:", "",
              "| model | engine | largest sub-group MiB | steps ≤ ckpt | during ckpt | ckpt − steps | ≤ one sub-group | "
              "job, no ckpt (control) | job, with ckpt | raise | ≤ one sub-group | next step vs control | "
              "locked left by ckpt | resumed run's steps | vs uninterrupted | file RSS left by resume |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, m in results["models"].items():
        for engine in ENGINES:
            s = m.get(engine) or {}
            if not s.get("ok"):
                continue
            mib = (MIB, "{:+.0f}")
            lines.append(
                f"| {model} | {engine} | {_f(s['largest_sub_group_bytes'], MIB, '{:.0f}')} | "
                f"{_f(s['peak_rss_training'])} | {_f(s['peak_rss_checkpoint'])} | "
                f"{_f(s['checkpoint_raise_bytes'], *mib)} | {_ok(s['staging_check_ok'])} | "
                f"{_f(s.get('control_job_peak_rss'))} | {_f(s['job_peak_rss'])} | "
                f"{_f(s.get('job_peak_raise_bytes'), *mib)} | {_ok(s.get('job_peak_check_ok'))} | "
                f"{_f(s.get('next_step_peak_raise_bytes'), *mib)} | {_f(s['locked_bytes_left_by_checkpoint'], *mib)} | "
                f"{_f(s.get('resumed_step_peak_rss'))} | {_f(s.get('resumed_step_peak_raise_bytes'), *mib)} | "
                f"{_f(s.get('resume_file_rss_left_bytes'), *mib)} |")
        r = m.get("ratios")
        if r:
            lines.append(f"| {model} | **memstrata / stock** | | {r['peak_rss_training_ratio']} | "
                         f"{r['peak_rss_checkpoint_ratio']} | | | | {r['job_peak_rss_ratio']} | | | | | "
                         f"{r['resumed_step_peak_rss_ratio']} | | |")
    mach = results["machine"]
    lines += ["", f"{mach['cpu']}, {mach['cores']} cores, {mach['dram_bytes'] / GIB:.1f} GiB, kernel {mach['kernel']}; "
              f"the NVMe stratum (file-backed) and the checkpoints on {mach['scratch']} ({mach['scratch_fs']}); DRAM "
              f"budgets {json.dumps({k: DRAM_BUDGETS[k] for k in results['models']})}. Peaks are exact per phase "
              "(VmHWM reset at each phase change, plus 2 ms samples). 'steps ≤ ckpt': the highest over the training "
              "steps up to the checkpoint; 'job': every phase but teardown (init, validation, steps, checkpoint); "
              "'control': the same job without spec.checkpoint, its own process; 'next step vs control': the step "
              "after the checkpoint against the same step of the control; 'resumed run's steps' against the same "
              "steps of the uninterrupted run. Load average at start "
              f"{results['loadavg_start']}, end {results.get('loadavg_end')} (shared machine); "
              f"total {results.get('total_seconds', 0) / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--every", type=int, default=2, help="a checkpoint every this many steps")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per worker process")
    ap.add_argument("--scratch", type=Path, default=Path("/var/tmp/memstrata-bench-checkpoint"),
                    help="on a disk filesystem: the NVMe stratum's files and the checkpoints")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="skip the control run (the same job without a checkpoint) per model and engine")
    ap.add_argument("--trim-after-save", dest="worker_args", action="append_const", const="--trim-after-save",
                    default=[], help="diagnostic (worker.py): memstrata gives its idle pool back after a checkpoint")
    ap.add_argument("--copy-resumed-tensors", dest="worker_args", action="append_const",
                    const="--copy-resumed-tensors", help="diagnostic (worker.py): resume from copies, not mappings")
    ap.add_argument("--name", default="checkpoint", help="results file name under benchmarks/results/")
    ap.add_argument("--from-json", type=Path, help="rebuild the table from an earlier run's JSON, running nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        for m in results["models"].values():
            for engine in ENGINES:
                if engine in m.get("runs", {}):
                    m[engine] = summarize(m["runs"][engine], results["args"]["steps"])
        print(render(results, png=f"{args.from_json.stem}.png"), end="")
        return 0
    if args.every > args.steps - 1:
        raise SystemExit("--every must leave at least one step after the checkpoint (to resume into)")
    args.scratch.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.scratch).free
    print(f"scratch {args.scratch}: {free / GIB:.1f} GiB free", flush=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "args": {"models": args.models, "seq": args.seq, "steps": args.steps, "every": args.every,
                 "micro_batch": 1, "precision": "bf16", "control": args.control, "worker_args": args.worker_args},
        "machine": machine(args.scratch), "loadavg_start": [round(x, 2) for x in os.getloadavg()], "models": {}}
    for preset in args.models.split(","):
        m: dict[str, Any] = {"dram_budget": DRAM_BUDGETS[preset], "runs": {}}
        for engine in ENGINES:
            m["runs"][engine] = run_pair(preset, engine, args, args.scratch)
            m[engine] = summarize(m["runs"][engine], args.steps)
            print(json.dumps({k: v for k, v in m[engine].items() if k != "sub_group_numels"}), flush=True)
        if m["memstrata"].get("ok") and m["deepspeed"].get("ok"):
            m["ratios"] = ratios(m["memstrata"], m["deepspeed"])
        results["models"][preset] = m
    write_results(results, RESULTS, args.name, partial(render, png=f"{args.name}.png"), t0, plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
