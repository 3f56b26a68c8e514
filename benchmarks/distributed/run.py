"""Ranks on one node: 1 rank vs 2 ranks (spec.resources.ranksPerNode 2) with the same global batch, per engine.

    python benchmarks/distributed/run.py                              # gpt-125m, both engines, 4 steps
    python benchmarks/distributed/run.py --model gpt-tiny --steps 3   # a smoke run in a minute or two
    MEMSTRATA_BENCH_MODEL=gpt-tiny python benchmarks/distributed/run.py

Per engine (memory.engine memstrata and deepspeed), the same FineTuneJob twice through `memstrata run`
(synthetic data, bf16, no GPU, micro-batch 1, --report-json): 1 rank with gradientAccumulation 2, and 2 gloo
ranks of one node (torch elastic, memstrata.runtime.train.launch) with gradientAccumulation 1, so both take
the same 2 sequences per optimizer step (global batch = microBatch x gradientAccumulation x world size).

Measured: tokens per second over the steps after the first (the first pays for DeepSpeed's warm-up), from
the job's metrics.jsonl; the peak RSS of the whole process tree of `memstrata run` (the elastic agent and its
workers), sampled every 20 ms from outside; the runtime's own DRAM peak and the plan's DRAM for the node; the
per-step losses (the two layouts see the same samples per step, so they should agree closely). One run each,
2 ranks / 1 rank ratios per engine.

The DRAM budget is per engine (--budget): memstrata's swap layer is measured with the weights and most of the
optimizer state on the (file-backed) NVMe stratum, as a job that needs offloading has; stock DeepSpeed's
page-locked pools for gpt-125m alone exceed any budget small enough to spill (its plan would not fit), so it
runs with its state in DRAM (ZeRO-Offload to the CPU). Compare 1 vs 2 ranks within an engine, not engines.
Writes benchmarks/results/distributed.json, distributed.md and distributed.png (distributed_plot.py, where
matplotlib imports).
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
RESULTS = REPO / "benchmarks" / "results"
sys.path[:0] = [str(REPO / "runtime"), str(REPO / "operator"), str(REPO / "benchmarks"),
                str(Path(__file__).resolve().parent)]
from record import machine, run_watched, write_results  # noqa: E402
from distributed_plot import plot  # noqa: E402

ENGINES = ("memstrata", "deepspeed")
LAYOUTS = ((1, 2), (2, 1))  # (ranks per node, gradient accumulation): the same global batch of 2 sequences
DEFAULT_BUDGETS = {"memstrata": "1Gi", "deepspeed": "2Gi"}
MIB, GIB = 1 << 20, 1 << 30


def job_yaml(model: str, engine: str, *, ranks: int, ga: int, seq: int, steps: int, budget: str,
             output: Path) -> str:
    return f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: dist-{model}-{engine}-{ranks}r}}
spec:
  model: {{preset: {model}}}
  dataset: {{synthetic: arithmetic}}
  training: {{sequenceLength: {seq}, microBatch: 1, gradientAccumulation: {ga}, steps: {steps}, precision: bf16,
             seed: 1234}}
  resources: {{gpus: 0, ranksPerNode: {ranks}}}
  memory: {{engine: {engine}, dramBudget: {budget}}}
  output: {{path: {output}, metricsPath: {output}-metrics}}
"""


def memstrata_run(job: Path, nvme: Path, report: Path, timeout: float) -> dict[str, Any]:
    """`memstrata run JOB --report-json REPORT`, its whole process tree's peak RSS watched from outside."""
    cmd = [sys.executable, "-m", "memstrata.cli", "run", str(job), "--nvme-path", str(nvme),
           "--report-json", str(report)]
    run = run_watched(cmd, REPO, timeout)
    if run.returncode != 0 or not report.exists():
        return {"ok": False, "error": run.error(), "wall_seconds": run.wall_seconds}
    return {"ok": True, "report": json.loads(report.read_text()), "wall_seconds": run.wall_seconds,
            "tree_peak_rss_bytes": run.tree_peak_rss_bytes}


def plan_of(job: Path, nvme: Path) -> dict[str, Any]:
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job

    plan = plan_job(load_job(job).spec, local_inventory(nvme))
    return {"feasible": plan.feasible, "verdict": plan.verdict(), "world_size": plan.world_size,
            "global_batch": plan.global_batch, "dram_bytes": plan.bytes_on("dram"), "nvme_bytes": plan.bytes_on("nvme"),
            "rank_bytes": plan.rank_bytes}


def one(model: str, engine: str, ranks: int, ga: int, args: argparse.Namespace) -> dict[str, Any]:
    work = args.scratch / f"{model}-{engine}-{ranks}r"
    shutil.rmtree(work, ignore_errors=True)
    nvme, output = work / "nvme", work / "model"
    nvme.mkdir(parents=True)
    job = work / "job.yaml"
    job.write_text(job_yaml(model, engine, ranks=ranks, ga=ga, seq=args.seq, steps=args.steps,
                            budget=args.budgets[engine], output=output))
    res: dict[str, Any] = {"model": model, "engine": engine, "ranks": ranks, "gradient_accumulation": ga,
                           "dram_budget": args.budgets[engine]}
    try:
        res["plan"] = plan_of(job, nvme)
        print(f"== {model} {engine}: {ranks} rank(s), gradientAccumulation {ga}", flush=True)
        res["run"] = memstrata_run(job, nvme, work / "report.json", args.timeout)
        if not res["run"]["ok"]:
            print(res["run"]["error"], flush=True)
            return res
        metrics = Path(f"{output}-metrics") / "metrics.jsonl"
        res["steps"] = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r and
                        r.get("tokens")] if metrics.exists() else []
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    run = r.get("run") or {}
    if not run.get("ok"):
        return {"ok": False, "error": run.get("error", "not run")}
    rep, steps = run["report"], r.get("steps", [])
    steady = steps[1:] or steps
    seconds = sum(s["seconds"] for s in steady)
    out = {
        "ok": True,
        "tokens_per_second": sum(s["tokens"] for s in steady) / seconds if seconds else None,
        "tokens_per_second_report": rep.get("tokens_per_second"),
        "step_seconds": statistics.median(s["seconds"] for s in steady) if steady else None,
        "tokens_per_step": steady[0]["tokens"] if steady else None,
        "tree_peak_rss_bytes": run["tree_peak_rss_bytes"],
        "runtime_dram_peak_bytes": (rep.get("strata") or {}).get("dram", {}).get("peak_bytes"),
        "plan_dram_bytes": r["plan"]["dram_bytes"],
        "plan_nvme_bytes": r["plan"]["nvme_bytes"],
        "losses": [s["loss"] for s in steps],
        "wall_seconds": run["wall_seconds"],
    }
    return out


def compare(one_rank: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    """2 ranks / 1 rank, and how far the per-step losses of the two layouts are apart."""
    out: dict[str, Any] = {}
    for key in ("tokens_per_second", "tree_peak_rss_bytes", "runtime_dram_peak_bytes", "plan_dram_bytes"):
        a, b = two.get(key), one_rank.get(key)
        out[key + "_ratio"] = round(a / b, 3) if a is not None and b else None
    pairs = list(zip(one_rank["losses"], two["losses"]))
    out["loss_max_rel_diff"] = max((abs(x - y) / abs(x) for x, y in pairs if x), default=None)
    return out


def _f(v: Any, scale: float = GIB, fmt: str = "{:.2f}") -> str:
    return fmt.format(v / scale) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def render(results: dict[str, Any], png: str | None = None) -> str:
    """The Markdown tables; `png`, the plot's file name beside it, is linked above them."""
    a = results["args"]
    lines = [f"# Ranks on one node: 1 rank vs 2 ranks, same global batch ({a['model']}, seq {a['seq']}, "
             f"global batch 2, {a['steps']} steps, bf16, CPU)", "",
             *([f"![tokens/s and peak DRAM against ranks, per engine]({png})", ""] if png else []),
             "| engine | DRAM budget | ranks x GA | tokens/s | step s | process tree peak GiB | runtime DRAM peak GiB "
             "| plan DRAM GiB | plan NVMe GiB | losses |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for engine in ENGINES:
        e = results["engines"].get(engine)
        if not e:
            continue
        for key in ("1", "2"):
            s, ga = e.get(key), 2 if key == "1" else 1
            if s is None:  # not asked for (--ranks)
                continue
            if not s.get("ok"):
                err = (s.get("error") or "").splitlines()[-1:] or [""]
                lines.append(f"| {engine} | {e['dram_budget']} | {key} x {ga} | failed: `{err[0][:140]}` |" + " |" * 6)
                continue
            losses = ", ".join(f"{x:.4f}" for x in s["losses"])
            lines.append(f"| {engine} | {e['dram_budget']} | {key} x {ga} | {_f(s['tokens_per_second'], 1, '{:.0f}')} | "
                         f"{_f(s['step_seconds'], 1)} | {_f(s['tree_peak_rss_bytes'])} | "
                         f"{_f(s['runtime_dram_peak_bytes'])} | {_f(s['plan_dram_bytes'])} | "
                         f"{_f(s['plan_nvme_bytes'])} | {losses} |")
        c = e.get("ratio")
        if c:
            lines.append(f"| {engine} | | **2 ranks / 1 rank** | {c['tokens_per_second_ratio']} | | "
                         f"{c['tree_peak_rss_bytes_ratio']} | {c['runtime_dram_peak_bytes_ratio']} | "
                         f"{c['plan_dram_bytes_ratio']} | | max relative loss difference "
                         f"{_f(c['loss_max_rel_diff'], 1, '{:.1e}')} |")
    m = results["machine"]
    lines += ["", f"{m['cpu']}, {m['cores']} cores, {m['dram_bytes'] / GIB:.1f} GiB, kernel {m['kernel']}; the NVMe "
              f"stratum file-backed on {m['scratch']} ({m['scratch_fs']}). One `memstrata run` per row; tokens/s over "
              "the steps after the first (metrics.jsonl); 'process tree peak': the RSS of `memstrata run` and all its "
              "children (the elastic agent and its workers), 20 ms samples from outside; 'runtime DRAM peak': what "
              "the run reported (status peakMemory); 'plan': memstrata.plan for one node of this job. Both layouts "
              "take the same 2 sequences per step (1 rank x gradientAccumulation 2, 2 ranks x 1). "
              f"Load average at start {results['loadavg_start']}, end {results.get('loadavg_end')} (shared machine); "
              f"total {results.get('total_seconds', 0) / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def _budgets(text: str) -> dict[str, str]:
    budgets = dict(DEFAULT_BUDGETS)
    for part in filter(None, text.split(",")):
        engine, _, value = part.partition("=")
        if engine not in ENGINES or not value:
            raise SystemExit(f"--budget {text!r}: expected ENGINE=SIZE[,ENGINE=SIZE] with ENGINE one of {ENGINES}")
        budgets[engine] = value
    return budgets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("MEMSTRATA_BENCH_MODEL", "gpt-125m"),
                    help="a preset (default: $MEMSTRATA_BENCH_MODEL or gpt-125m)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--ranks", default="1,2", help="which layouts to run: 1 (x GA 2), 2 (x GA 1) or both")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=_budgets, default=dict(DEFAULT_BUDGETS), dest="budgets",
                    help="memory.dramBudget per engine, e.g. memstrata=1Gi,deepspeed=2Gi (the defaults)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per `memstrata run`")
    ap.add_argument("--scratch", type=Path, default=Path("/var/tmp/memstrata-bench-distributed"),
                    help="on a disk filesystem: the NVMe stratum's files and the outputs")
    ap.add_argument("--name", default="distributed", help="results file name under benchmarks/results/")
    ap.add_argument("--from-json", type=Path, help="rebuild the table from an earlier run's JSON, running nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        print(render(json.loads(args.from_json.read_text()), png=f"{args.from_json.stem}.png"), end="")
        return 0
    args.scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    wanted = {int(r) for r in args.ranks.split(",")}
    results: dict[str, Any] = {
        "args": {"model": args.model, "seq": args.seq, "steps": args.steps, "micro_batch": 1, "global_batch": 2,
                 "precision": "bf16", "budgets": args.budgets},
        "machine": machine(args.scratch), "loadavg_start": [round(x, 2) for x in os.getloadavg()], "engines": {}}
    for engine in args.engines.split(","):
        e: dict[str, Any] = {"dram_budget": args.budgets[engine], "runs": {}}
        for ranks, ga in LAYOUTS:
            if ranks in wanted:
                e["runs"][str(ranks)] = one(args.model, engine, ranks, ga, args)
                e[str(ranks)] = summarize(e["runs"][str(ranks)])
                print(json.dumps(e[str(ranks)]), flush=True)
        if (e.get("1") or {}).get("ok") and (e.get("2") or {}).get("ok"):
            e["ratio"] = compare(e["1"], e["2"])
        results["engines"][engine] = e
    write_results(results, RESULTS, args.name, partial(render, png=f"{args.name}.png"), t0, plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
