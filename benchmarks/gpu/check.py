"""One command that checks memstrata on a GPU machine: the GPU tests, then short side-by-side runs, most important
first, each under its own time limit, results written as they come.

    python benchmarks/gpu/check.py                      # a GPU machine: llama3.2-1b at 2K and 32K tokens, < 8 min
    python benchmarks/gpu/check.py --cpu --out DIR      # the same plumbing on the CPU with gpt-tiny (make test)
    python benchmarks/gpu/check.py --only runs --items memstrata-14Gi,stock-14Gi   # a part of it

Each run is one `memstrata run` of a FineTuneJob (benchmarks/longctx/worker.py: the local recipe, planned for this
machine) in its own process tree: memstrata and stock ZeRO-Infinity at an NVMe-heavy DRAM budget where both fit,
memstrata at a budget where stock's plan does not fit (stock's refusal is the planner's), both at 32K tokens, an
fp16 run, a LoRA run, a fine-tune whose exported model is reloaded with transformers and must give the engine's
validation loss, and both with everything in DRAM. Per run: tokens/s over the steps after the first, the peak RSS
(the kernel's high-water mark) against the plan's DRAM, the device's memory peak, the losses. After each item
`<out>/gpu-check.json` and `.md` (and a plot, where matplotlib is) are rewritten, so a check stopped by its time
limit keeps everything it finished; the targets memstrata is held to are judged at the end of the table.
Assumes nothing of the machine beyond importable dependencies (../shared/gpu/README.md brings them to a bare one).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "longctx"), str(REPO / "runtime"),
                str(REPO / "operator")]

import items as catalogue  # noqa: E402
from items import Item  # noqa: E402
from record import machine, run_watched  # noqa: E402
from report import write  # noqa: E402
from sweep import steady  # noqa: E402

WORKER = HERE.parent / "longctx" / "worker.py"
RELOAD = HERE / "reload.py"
# The GPU tests: skipped without a GPU (here they are the first item, so a broken GPU path is named first).
GPU_TESTS = ["tests/runtime/test_activation_offload.py", "tests/native/test_pinned.py",
             "tests/offload/test_gpu_paths.py", "tests/offload/test_layer_major.py"]


def run_tests(item: Item, limit: float, out: Path) -> dict[str, Any]:
    log = out / "gpu-tests.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider", *GPU_TESTS]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}:" + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text, rc = f"timed out after {limit:.0f} s\n{exc.stdout or ''}", 124
    log.write_text(text)
    summary = next((ln for ln in reversed(text.splitlines()) if " in " in ln and ("passed" in ln or "skipped" in ln
                                                                                   or "failed" in ln)), text[-300:])
    ok = rc == 0 or (rc == 5 and "deselected" in text)  # 5: nothing collected
    failed = [ln for ln in text.splitlines() if ln.startswith("FAILED")]
    return {"ok": ok and not failed, "status": "passed" if ok and not failed else "failed", "summary": summary.strip(),
            "failed": failed[:10], "log": log.name}


def run_job(item: Item, limit: float, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    work = scratch / item.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    job = work / "job.yaml"
    job.write_text(catalogue.manifest(item, args.profile, output=work / "model" if item.export else None))
    if item.plan_only:
        return catalogue.plan_verdict(job, work / "nvme", gpu=not args.cpu, expect=item.expect)
    cmd = [sys.executable, str(WORKER), "--job", str(job), "--nvme-path", str(work / "nvme"), "--out",
           str(work / "result.json"), *([] if args.cpu else ["--gpu"])]
    w = run_watched(cmd, REPO, limit)
    data = json.loads((work / "result.json").read_text()) if (work / "result.json").exists() else {}
    rec = measured(data)
    rec.update(wall_seconds=round(w.wall_seconds, 1), tree_peak_rss_bytes=w.tree_peak_rss_bytes)
    if w.returncode != 0 or data.get("rc") != 0:
        rec.update(ok=False, status="failed", error=(data.get("error") or w.error())[-1500:])
    elif item.export:
        rec.update(reloaded(work, job, rec, limit - w.wall_seconds, args.cpu))
    if not args.keep:
        shutil.rmtree(work / "nvme", ignore_errors=True)
    return rec


def measured(data: dict[str, Any]) -> dict[str, Any]:
    """A finished run's figures (what benchmarks/longctx/worker.py wrote)."""
    report = data.get("report") or {}
    steps = data.get("steps") or []
    dram = (report.get("memstrata") or {}).get("dram") or {}
    return {"ok": data.get("rc") == 0, "status": "completed" if data.get("rc") == 0 else "failed",
            "tokens_per_second": steady(steps), "step_tokens_per_second": [s["tokens_per_second"] for s in steps],
            "losses": [s["loss"] for s in steps], "validation_losses": report.get("validation_losses"),
            "peak_rss_bytes": data.get("max_rss_bytes"), "report_peak_rss_bytes": report.get("peak_rss_bytes"),
            "plan_dram_bytes": data.get("plan_dram_bytes"), "plan_hbm_bytes": data.get("plan_hbm_bytes"),
            "hbm_peak_bytes": data.get("gpu_peak_bytes"),
            "hbm_allocated_peak_bytes": data.get("gpu_allocated_peak_bytes"),
            "strata": report.get("strata"), "phases": report.get("phases"), "offload": report.get("offload"),
            "pinned_bytes": dram.get("pinnedBytes"), "activations": (report.get("memstrata") or {}).get("activations"),
            "update": (report.get("memstrata") or {}).get("updateOverlap")}


def reloaded(work: Path, job: Path, rec: dict[str, Any], limit: float, cpu: bool) -> dict[str, Any]:
    """The exported model, loaded by transformers: its validation loss against the engine's last one."""
    cmd = [sys.executable, str(RELOAD), str(work / "model"), str(job), *(["--cpu"] if cpu else [])]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}:" + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(limit, 30))
    except subprocess.TimeoutExpired:
        return {"ok": False, "status": "failed", "error": "the reload timed out"}
    if proc.returncode != 0:
        return {"ok": False, "status": "failed", "error": f"reload: {proc.stderr[-1500:]}"}
    got = json.loads(proc.stdout.strip().splitlines()[-1])["validation_loss"]
    engine = (rec.get("validation_losses") or {})
    last = engine[max(engine, key=int)] if engine else None
    close = last is not None and abs(got - last) <= 0.01 * abs(last)
    return {"reloaded_validation_loss": got, "engine_validation_loss": last, "ok": close,
            "status": "completed" if close else "failed",
            **({} if close else {"error": f"the reloaded model's validation loss {got} is not the engine's {last}"})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the CPU profile (gpt-tiny); the default where no GPU is")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--scratch", type=Path, default=None, help="runs' scratch (a disk filesystem); default under --out")
    ap.add_argument("--only", choices=["tests", "runs"], help="the GPU tests alone, or the runs alone")
    ap.add_argument("--items", default="", help="comma-separated item names (default: all, in order)")
    ap.add_argument("--budget-seconds", type=float, default=None, help="stop starting items after this long")
    ap.add_argument("--keep", action="store_true", help="keep the runs' namespaces and models")
    args = ap.parse_args(argv)
    if not args.cpu:
        import torch

        args.cpu = not torch.cuda.is_available()
    args.profile = catalogue.CPU if args.cpu else catalogue.GPU
    budget = args.budget_seconds or args.profile.budget_seconds
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or args.out / "gpu-check-scratch"
    results_path = args.out / f"{args.profile.result_name}.json"
    # A second invocation (the runs after the tests, or a part) adds to what the first wrote.
    results = json.loads(results_path.read_text()) if results_path.exists() and args.only != "tests" else {}
    results.update(benchmark="gpu-check", profile=args.profile.name, machine=machine(args.out), items=results.get(
        "items", {}), gpu=catalogue.gpu_name())
    started = time.monotonic()
    chosen = [n for n in args.items.split(",") if n] or [i.name for i in args.profile.items]
    for item in (i for i in args.profile.items if i.name in chosen):
        if (args.only == "tests") != (item.kind == "tests") and args.only is not None:
            continue
        left = budget - (time.monotonic() - started)
        if left < item.least_seconds:
            results["items"][item.name] = {"ok": False, "status": "not run",
                                           "error": f"{left:.0f} s of the {budget:.0f} s budget left"}
            continue
        why = catalogue.cannot_run(item, args.cpu)
        if why is not None:
            results["items"][item.name] = {"ok": True, "status": "skipped", "error": why, **item.describe()}
            continue
        limit = min(item.limit_seconds, left)
        print(f"== {item.name} (at most {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        rec = run_tests(item, limit, args.out) if item.kind == "tests" else run_job(item, limit, args, scratch)
        rec.update(seconds=round(time.monotonic() - t0, 1), limit_seconds=round(limit), **item.describe())
        results["items"][item.name] = rec
        print(json.dumps({k: rec.get(k) for k in ("status", "tokens_per_second", "peak_rss_bytes", "hbm_peak_bytes",
                                                   "summary", "error")}), flush=True)
        write(results, args.out, args.profile)
    write(results, args.out, args.profile)
    return 0 if all(r.get("ok") or r.get("status") == "not run" for r in results["items"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
