"""memstrata vs stock ZeRO-Infinity at every DRAM budget (run as root: cgroups and loop devices).

    python benchmarks/offload/run.py --models gpt-125m,gpt-350m --seq 128 --batch 1

Caps are base + k bytes/param; base is what a run holds beside its state: the peak of memstrata with everything
in DRAM under a roomy cap minus 16 B/param (where that probe fails, the planner's working set and build transient
plus the RSS of an idle interpreter that imported torch and deepspeed). Every run is benchmarks/offload/harness.py
in its own process tree inside its own cgroup memory group capped at its cap (memcap.py: v2 or v1): memstrata
with what the planner plans for that cap (an infeasible plan is refused, not run), stock with DeepSpeed's
defaults ('stock-default'), with the buffer counts memstrata's stock config uses ('stock-tuned') and with
everything offloaded to the CPU ('stock-cpu'). Both engines build the model under zero.Init in bf16.

Per model, first each contender's floor: the smallest k it completes under, bisected with short runs
(--probe-warmup 1 + --probe-measured 2 steps; budget.next_k: the all-fits k (24) first, then midpoints until the
interval is max(0.5 B/param, 10% of k); an OOM kill, MemoryError/ENOMEM or the planner's refusal means "more
memory", a crash or timeout stops that contender's bisection with its reason). Then full runs (--warmup +
--measured steps) at memstrata's floor k, each stock floor k above it (or a midpoint) and the all-fits k, by
every contender whose floor is at or below that k (at all-fits only --all-fits-contenders). --caps-bytes-per-param
2.2,8,16 instead runs every contender at those ks and the all-fits k, without bisecting.

fio first measures the scratch disk; every step's bytes on that disk come from /proc/diskstats, so each run has
its I/O time beside it and two bounds: overlapped max(compute, I/O) (the target's) and serial compute + I/O.
Parameter bytes read per step: memstrata's from its swap layer's 'param' counter, stock's are all its reads.
Writes benchmarks/results/<--name>.json, .md and .png (the plot, where matplotlib imports; default
offload-budget); --from-json FILE re-summarises an earlier run's records, running nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "runtime"), str(HERE.parents[1] / "operator")]

import budget  # noqa: E402
import contenders  # noqa: E402
from budget_md import markdown  # noqa: E402
from budget_plot import plot  # noqa: E402
from diskstats import device_of  # noqa: E402
from memcap import DramCap  # noqa: E402
from record import machine, write_results  # noqa: E402

RESULTS = HERE.parents[1] / "benchmarks" / "results"
TMPFS_MAGIC = 0x01021994
IDLE_PROBE = ("import os, torch, deepspeed; print(next(int(l.split()[1]) * 1024 for l in "
              "open('/proc/self/status') if l.startswith('VmRSS:')))")


def fs_magic(path: Path) -> int:
    """statfs f_type of `path` (Python's os.statvfs does not expose it)."""
    import ctypes

    class Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    buf = Statfs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        raise OSError(ctypes.get_errno(), f"statfs {path}")
    return buf.f_type & 0xFFFFFFFF


def idle_interpreter_rss() -> int:
    """RSS of a fresh interpreter that imported torch and deepspeed: every contender pays it before any state."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", IDLE_PROBE], check=True, capture_output=True, text=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def idle_interpreter_charge() -> int | None:
    """What a capped group is charged for that same idle interpreter (its peak under a roomy cap): less than its
    RSS where the libraries' pages are already in the page cache, charged to whoever read them first."""
    cap, _ = DramCap.open("idle", 8 << 30)
    if cap is None:
        return None
    try:
        subprocess.run([sys.executable, "-c", IDLE_PROBE], check=True, capture_output=True,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"}, preexec_fn=cap.preexec)
        return cap.peak_bytes()
    finally:
        cap.close()


def cap_mechanism() -> dict[str, Any]:
    probe, why = DramCap.open("probe", 1 << 30)
    if probe is None:
        return {"enforced": False, "why_not": why}
    probe.close()
    return {"enforced": True, "cgroup_version": probe.version, "mechanism": probe.mechanism}


# What a run holds per parameter beside its base: 16-bit weights and gradients, fp32 master and two moments.
STATE_BYTES_PER_PARAM = 2 + 2 + 12


def model_record(name: str, args: argparse.Namespace, idle: int, scratch: Path) -> dict[str, Any]:
    from memstrata.api.architecture import PRESETS

    arch = PRESETS[name]
    planned = contenders.planned_base(arch, args.seq, args.batch, args.gpu)
    return {"params": arch.parameters(), "planned_base_bytes": planned, "base_bytes": planned + idle,
            "all_fits_k": args.all_fits_bytes_per_param,
            "stock_cpu_planned_bytes": contenders.stock_cpu_bytes(arch, args.seq, args.batch, scratch, args.gpu) + idle,
            "caps": []}


def _cap(m: dict[str, Any], k: float) -> dict[str, Any]:
    return {"k": k, "bytes": int(m["base_bytes"] + k * m["params"]), "all_fits": k == m["all_fits_k"], "runs": []}


def run_model(name: str, m: dict[str, Any], args: argparse.Namespace, scratch: Path, backing: str,
              save: Any) -> None:
    from memstrata.api.architecture import PRESETS

    arch = PRESETS[name]

    def run(contender: str, cap: dict[str, Any], warmup: int, measured: int) -> dict[str, Any]:
        return contenders.run_contender(contender, arch_name=name, arch=arch, seq=args.seq, batch=args.batch,
                                        warmup=warmup, measured=measured, cap=cap, base=m["base_bytes"],
                                        scratch=scratch, backing=backing, timeout=args.timeout, gpu=args.gpu)

    # The base is measured, not guessed: the interpreter, transformers, DeepSpeed's ops, the allocator's slack and
    # the activations are what a run holds beside its 16 B/param of state (weights 2, gradients 2, master and
    # moments 12). memstrata with everything in DRAM, under a cap far above it, shows it: base = peak - 16 x P.
    probe_cap = {"k": "probe", "bytes": m["planned_base_bytes"] + 20 * arch.parameters() + (6 << 30), "all_fits": True}
    probe = run("memstrata", probe_cap, 1, 2)
    m["base_probe"] = {k: probe.get(k) for k in ("ok", "error", "peak_rss_bytes", "cgroup")}
    if probe.get("ok"):
        m["base_bytes"] = int(probe["peak_rss_bytes"] - STATE_BYTES_PER_PARAM * arch.parameters())
    save()
    if args.caps_bytes_per_param:
        explicit_caps(m, args, run, save)
    else:
        floors = bisect_floors(m, args, run, save)
        m["caps"] = [_cap(m, k) for k in budget.measure_ks(floors, m["all_fits_k"])]
        for cap in m["caps"]:
            for contender in budget.fits_at(floors, cap["k"]):
                if cap["all_fits"] and contender not in args.all_fits_contenders.split(","):
                    continue
                cap["runs"].append(run(contender, cap, args.warmup, args.measured))
                save()  # after every run, so a later failure or timeout keeps what was measured


def bisect_floors(m: dict[str, Any], args: argparse.Namespace, run: Any, save: Any) -> dict[str, dict[str, Any]]:
    """Each contender's floor, bisected with short runs (budget.next_k): {contender: budget.floor_of(...)}."""
    top = m["all_fits_k"]
    m["floors"] = {}
    for contender in args.contenders.split(","):
        probes: list[dict[str, Any]] = []
        m["floors"][contender] = {"probes": probes}
        while len(probes) < args.max_probes and (
                k := budget.next_k([(p["k"], budget.outcome(p)) for p in probes], top)) is not None:
            cap = _cap(m, k)
            probes.append({**run(contender, cap, args.probe_warmup, args.probe_measured), "k": k,
                           "bytes": cap["bytes"]})
            save()
    return {n: budget.floor_of(f["probes"], top) for n, f in m["floors"].items()}


def explicit_caps(m: dict[str, Any], args: argparse.Namespace, run: Any, save: Any) -> None:
    """--caps-bytes-per-param: every contender at each given k and the all-fits k (no bisection)."""
    ks = [float(k) for k in args.caps_bytes_per_param.split(",")]
    m["caps"] = [{**c, "runs": []} for c in budget.caps(m["base_bytes"], m["params"], ks, m["all_fits_k"])]
    for cap in m["caps"]:
        names = args.all_fits_contenders if cap["all_fits"] else args.contenders
        for contender in names.split(","):
            if contender == "stock-cpu" and m["stock_cpu_planned_bytes"] > cap["bytes"]:
                cap["runs"].append({"contender": contender, "ok": False, "skipped": True,
                                    "error": f"skipped: the planner's stock CPU bytes "
                                             f"{m['stock_cpu_planned_bytes'] / 2**30:.2f} GiB exceed the "
                                             f"{cap['bytes'] / 2**30:.2f} GiB cap"})
                continue
            cap["runs"].append(run(contender, cap, args.warmup, args.measured))
            save()


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    results["bound_formula"] = budget.BOUND_FORMULA  # what summarize_model computes, also for an older record
    for m in results["models"].values():
        budget.summarize_model(m, results.get("fio") or {}, results["backing_device"])
    return results


def draw(results: dict[str, Any], name: str) -> None:
    """The PNG beside the table (budget_plot: step time and peak host memory against k, floors marked)."""
    why = plot(results, RESULTS / f"{name}.png")
    print(why or f"wrote {RESULTS / (name + '.png')}", flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    ap.add_argument("--measured", type=int, default=8, help="steps measured after the warm-up")
    ap.add_argument("--caps-bytes-per-param", default="",
                    help="instead of bisecting floors: caps = base + k bytes/param for each k, e.g. 2.2,8,16 (an "
                         "all-fits cap is added)")
    ap.add_argument("--probe-warmup", type=int, default=1, help="warm-up steps of each bisection run")
    ap.add_argument("--probe-measured", type=int, default=2, help="measured steps of each bisection run")
    ap.add_argument("--max-probes", type=int, default=8, help="bisection runs per contender and model, at most")
    ap.add_argument("--all-fits-bytes-per-param", type=float, default=budget.ALL_FITS_BYTES_PER_PARAM)
    ap.add_argument("--contenders", default=",".join(contenders.CONTENDERS))
    ap.add_argument("--all-fits-contenders", default="memstrata,stock-cpu",
                    help="who runs at the all-fits cap (the all-DRAM comparison and the compute floor)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--fio-seconds", type=float, default=3.0)
    ap.add_argument("--scratch", default="/var/tmp/memstrata-bench-offload", help="on a disk filesystem")
    ap.add_argument("--name", default="offload-budget", help="results file name under benchmarks/results/")
    ap.add_argument("--from-json", type=Path, help="re-summarise an earlier run's records, running nothing")
    ap.add_argument("--gpu", action="store_true",
                    help="each contender as it runs on a GPU node (harness --gpu: cuda:0, NCCL, pinning, activation "
                         "checkpointing, the device's memory peak)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    if args.from_json:
        old = summarize(json.loads(args.from_json.read_text()))
        write_results(old, RESULTS, old.get("name", args.name), markdown, started - old.get("total_seconds", 0.0))
        draw(old, old.get("name", args.name))
        return 0
    from ceiling import measure

    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    if fs_magic(scratch) == TMPFS_MAGIC:
        raise SystemExit(f"{scratch} is on tmpfs: stock would swap to DRAM; pick a disk filesystem")
    backing = device_of(scratch)
    idle = idle_interpreter_rss()
    results: dict[str, Any] = {
        "benchmark": "offload-budget", "name": args.name, "machine": machine(scratch), "seq": args.seq,
        "batch": args.batch, "warmup": args.warmup, "measured": args.measured, "precision": "bf16", "gpu": args.gpu,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()], "backing_device": backing,
        "idle_interpreter_rss_bytes": idle, "idle_interpreter_cgroup_peak_bytes": idle_interpreter_charge(),
        "base_formula": budget.BASE_FORMULA, "dram_cap": cap_mechanism(),
        "statistic": f"median and spread over steps {args.warmup + 1}..{args.warmup + args.measured} "
                     f"(the first {args.warmup} are warm-up)",
        "bound_formula": budget.BOUND_FORMULA,
        "floor_rule": f"bisection per contender with {args.probe_warmup} warm-up + {args.probe_measured} measured "
                      f"steps: the all-fits k first (it must pass), k=0 assumed failing, then the midpoint of "
                      f"[highest failing k, lowest passing k] until it is at most max({budget.FLOOR_RESOLUTION} "
                      f"B/param, {budget.FLOOR_RELATIVE:.0%} of k) or {args.max_probes} runs; OOM kills, "
                      "MemoryError/ENOMEM and the planner refusing the cap count as failing, a crash or timeout "
                      "stops that contender's bisection",
        "models": {}}
    print(f"fio on {scratch} ({backing}) ...", flush=True)
    results["fio"] = measure(scratch, seconds=args.fio_seconds)
    print(json.dumps(results["fio"]), flush=True)

    def save() -> None:
        write_results(summarize(results), RESULTS, args.name, markdown, started)

    for name in args.models.split(","):
        results["models"][name] = model_record(name, args, idle, scratch)
        run_model(name, results["models"][name], args, scratch, backing, save)
    save()
    draw(results, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
