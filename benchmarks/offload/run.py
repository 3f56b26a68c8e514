"""memstrata vs stock ZeRO-Infinity at every DRAM budget (run as root: cgroups and loop devices).

    python benchmarks/offload/run.py --models gpt-125m,gpt-350m --seq 128 --batch 1

For each model, caps = base + k bytes/param for k in --caps-bytes-per-param (default 2.2, 8, 16) and one cap
where everything fits in DRAM (base + 20 B/param); base is the planner's working set and build transient of
the job plus the RSS of an idle interpreter that imported torch and deepspeed (measured once per run). At
each cap, each contender runs benchmarks/offload/harness.py in its own process tree inside its own cgroup
memory group capped at that cap (memcap.py: v2 or v1): memstrata with what the planner plans for that cap,
stock with DeepSpeed's defaults ('stock-default'), with the buffer counts memstrata's stock config uses
('stock-tuned') and with everything offloaded to the CPU ('stock-cpu', skipped where the planner says it
cannot fit). Both engines build the model under zero.Init in bf16. fio first measures the scratch disk;
every step's bytes on that disk come from /proc/diskstats, so each run has a bandwidth bound beside it.
Writes benchmarks/results/<--name>.json and .md (default offload-budget).
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
    base = planned + idle
    ks = [float(k) for k in args.caps_bytes_per_param.split(",")]
    return {"params": arch.parameters(), "planned_base_bytes": planned, "base_bytes": base,
            "stock_cpu_planned_bytes": contenders.stock_cpu_bytes(arch, args.seq, args.batch, scratch, args.gpu) + idle,
            "caps": [{**c, "runs": []}
                     for c in budget.caps(base, arch.parameters(), ks, args.all_fits_bytes_per_param)]}


def run_model(name: str, m: dict[str, Any], args: argparse.Namespace, scratch: Path, backing: str,
              save: Any) -> None:
    from memstrata.api.architecture import PRESETS

    arch = PRESETS[name]
    # The base is measured, not guessed: the interpreter, transformers, DeepSpeed's ops, the allocator's slack and
    # the activations are what a run holds beside its 16 B/param of state (weights 2, gradients 2, master and
    # moments 12). memstrata with everything in DRAM, under a cap far above it, shows it: base = peak - 16 x P.
    probe_cap = {"k": "probe", "bytes": m["planned_base_bytes"] + 20 * arch.parameters() + (6 << 30), "all_fits": True}
    probe = contenders.run_contender("memstrata", arch_name=name, arch=arch, seq=args.seq, batch=args.batch,
                                     warmup=1, measured=2, cap=probe_cap, base=0, scratch=scratch, backing=backing,
                                     timeout=args.timeout, gpu=args.gpu)
    m["base_probe"] = {k: probe.get(k) for k in ("ok", "error", "peak_rss_bytes", "cgroup")}
    if probe.get("ok"):
        m["base_bytes"] = int(probe["peak_rss_bytes"] - STATE_BYTES_PER_PARAM * arch.parameters())
        ks = [float(k) for k in args.caps_bytes_per_param.split(",")]
        m["caps"] = [{**c, "runs": []} for c in budget.caps(m["base_bytes"], arch.parameters(), ks,
                                                              args.all_fits_bytes_per_param)]
    save()
    for cap in m["caps"]:
        names = args.all_fits_contenders if cap["all_fits"] else args.contenders
        for contender in names.split(","):
            if contender == "stock-cpu" and m["stock_cpu_planned_bytes"] > cap["bytes"]:
                cap["runs"].append({"contender": contender, "ok": False, "skipped": True,
                                    "error": f"skipped: the planner's stock CPU bytes "
                                             f"{m['stock_cpu_planned_bytes'] / 2**30:.2f} GiB exceed the "
                                             f"{cap['bytes'] / 2**30:.2f} GiB cap"})
                continue
            cap["runs"].append(contenders.run_contender(
                contender, arch_name=name, arch=arch, seq=args.seq, batch=args.batch, warmup=args.warmup,
                measured=args.measured, cap=cap, base=m["base_bytes"], scratch=scratch, backing=backing,
                timeout=args.timeout, gpu=args.gpu))
            save()  # after every run, so a later failure or timeout keeps what was measured


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    for m in results["models"].values():
        budget.summarize_model(m, results.get("fio") or {}, results["backing_device"])
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    ap.add_argument("--measured", type=int, default=8, help="steps measured after the warm-up")
    ap.add_argument("--caps-bytes-per-param", default="2.2,8,16",
                    help="caps = base + k bytes/param for each k (an all-fits cap is added)")
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
    args = ap.parse_args()
    started = time.perf_counter()
    if args.from_json:
        old = summarize(json.loads(args.from_json.read_text()))
        write_results(old, RESULTS, old.get("name", args.name), markdown, started - old.get("total_seconds", 0.0))
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
        "bound_formula": "bound = read bytes / fio read B/s + write bytes / fio write B/s (median bytes per measured "
                         "step on the backing disk, from /proc/diskstats) + compute floor (median step of the "
                         "fastest all-DRAM run of the model at the all-fits cap)",
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
