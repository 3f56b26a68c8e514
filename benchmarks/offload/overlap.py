"""The optimizer update beside the next forward vs in place (run as root: cgroups and loop devices).

    python benchmarks/offload/overlap.py --models gpt-125m,gpt-350m --caps-bytes-per-param 8,13.75

memstrata at each DRAM cap base + k bytes/param (and the all-fits k) twice, in one run: with the update beside the
next forward ('memstrata-beside': SwapSettings.overlap_update true, which forces it on the CPU too;
memstrata.runtime.swap.overlap) and with it in place ('memstrata-in-place'), the same plan otherwise; each in its own process tree inside its own capped cgroup
(contenders.run_contender, as benchmarks/offload/run.py runs them). The base is the one the offload-budget
benchmark measured (benchmarks/results/offload-budget.json), so the caps are that benchmark's; a model it did not
run takes the planner's base plus an idle interpreter's RSS.

Per cap: both median steps (over --measured steps after --warmup), their ratio (beside / in place: below 1 is the
update's time hidden behind the forward), whether the losses are bit for bit the same, the overlap's own status
(updates run beside a forward, the forward's waits, the joins' waits), peak host memory of both, and each step
against its bound: I/O seconds (bytes on the scratch disk per step over fio's bandwidth) and the compute floor
(the faster all-fits step), overlapped max(compute, I/O) and serial compute + I/O. A cap whose plan keeps the
weights on NVMe runs both in place (the overlap is refused there, and says why).
Writes benchmarks/results/<--name>.json, .md and .png.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "runtime"), str(HERE.parents[1] / "operator")]

import budget  # noqa: E402
import contenders  # noqa: E402
from record import machine, pyplot, save_figure, write_results  # noqa: E402

RESULTS = HERE.parents[1] / "benchmarks" / "results"
PAIR = (contenders.BESIDE, contenders.IN_PLACE)


def summarize_cap(cap: dict[str, Any], fio: dict[str, Any] | None, backing: str, compute: float | None) -> None:
    """Fill in one cap's comparison in place (see the module)."""
    runs = {r["contender"]: r for r in cap["runs"]}
    beside, in_place = runs.get(PAIR[0]), runs.get(PAIR[1])
    for r in cap["runs"]:
        io = (r.get("io") or {}).get(backing)
        if r.get("ok") and io and fio:
            io_s = budget.io_seconds(io, fio["read_bytes_per_s"], fio["write_bytes_per_s"])
            r["bound"] = budget.step_bound(r["step"]["median"], io_s, compute)
        r["overlap"] = ((r.get("swap") or {}).get("updateOverlap")) if r.get("ok") else None
    if beside and in_place and beside.get("ok") and in_place.get("ok"):
        cap["step_ratio"] = round(beside["step"]["median"] / in_place["step"]["median"], 3)
        cap["memory_ratio"] = round(budget.host_peak(beside) / budget.host_peak(in_place), 3)
        cap["same_losses"] = beside["losses"] == in_place["losses"]


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    for m in results["models"].values():
        fits = next((c for c in m["caps"] if c["all_fits"]), None)
        done = [r["step"]["median"] for r in (fits["runs"] if fits else []) if r.get("ok")]
        compute = min(done) if done else None
        m["compute_floor_seconds"] = compute
        for cap in m["caps"]:
            summarize_cap(cap, results.get("fio"), results["backing_device"], compute)
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = ["# The update beside the next forward vs in place (memstrata)", "",
             f"![the update beside the forward vs in place]({results.get('name', 'offload-overlap')}.png)", "",
             f"seq {results['seq']}, batch {results['batch']}, bf16, {results['statistic']}; "
             f"{results['machine']['cores']} cores; bound: {budget.BOUND_FORMULA}", "",
             "| model | k (B/param) | cap GiB | weights | step beside s | step in place s | beside / in place | "
             "same losses | bound (overlapped) s | beside / bound | forward waited, all steps s | peak beside / in place |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        for cap in m["caps"]:
            runs = {r["contender"]: r for r in cap["runs"]}
            b, p = runs.get(PAIR[0], {}), runs.get(PAIR[1], {})
            weights = ((b.get("plan") or {}).get("offload_devices") or ["?"])[0]
            ov = b.get("overlap") or {}
            bound = b.get("bound") or {}
            state = "" if ov.get("on", True) else f" (in place: {ov.get('refused')})"
            lines.append(
                f"| {name} | {cap['k']} | {cap['bytes'] / 2**30:.2f} | {weights}{state} | {_step(b)} | {_step(p)} "
                f"| {cap.get('step_ratio', '-')} | {cap.get('same_losses', '-')} | "
                f"{bound.get('overlapped_seconds', '-')} | {bound.get('ratio', '-')} | "
                f"{ov.get('forwardWaitSeconds', '-')} | {cap.get('memory_ratio', '-')} |")
    return "\n".join(lines) + "\n"


def _step(run: dict[str, Any]) -> str:
    return f"{run['step']['median']:.3f}" if run.get("ok") else (run.get("error") or "-")[:60]


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Per model, the median step beside and in place against k, with the overlapped bound; None when written,
    else why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    models = results["models"]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6 * max(1, len(models)), 4.5), squeeze=False)
    for ax, (model, m) in zip(axes[0], models.items()):
        for i, contender in enumerate(PAIR):
            pts = sorted((float(c["k"]), r["step"]["median"]) for c in m["caps"] for r in c["runs"]
                         if r["contender"] == contender and r.get("ok"))
            ax.plot([k for k, _ in pts], [s for _, s in pts], "o-", color=f"C{i}",
                    label="update beside the forward" if contender == PAIR[0] else "update in place")
        bounds = sorted((float(c["k"]), r["bound"]["overlapped_seconds"]) for c in m["caps"] for r in c["runs"]
                        if r["contender"] == PAIR[0] and r.get("bound"))
        if bounds:
            ax.plot([k for k, _ in bounds], [s for _, s in bounds], "k--", label="bound max(compute, I/O)")
        ax.set(title=model, xlabel="DRAM cap: base + k bytes/param", ylabel="median step (s)")
        ax.legend()
    mach = results.get("machine") or {}
    fig.suptitle(f"memstrata: optimizer update beside the next forward vs in place (seq {results.get('seq')}, batch "
                 f"{results.get('batch')}); {mach.get('cpu', '?')}, {mach.get('cores', '?')} cores")
    save_figure(fig, path)
    return None


def draw(results: dict[str, Any], name: str) -> None:
    print(plot(results, RESULTS / f"{name}.png") or f"wrote {RESULTS / (name + '.png')}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--caps-bytes-per-param", default="8,13.75")
    ap.add_argument("--all-fits-bytes-per-param", type=float, default=budget.ALL_FITS_BYTES_PER_PARAM)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--measured", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--fio-seconds", type=float, default=3.0)
    ap.add_argument("--scratch", default="/var/tmp/memstrata-bench-offload")
    ap.add_argument("--base-from", type=Path, default=RESULTS / "offload-budget.json")
    ap.add_argument("--name", default="offload-overlap")
    ap.add_argument("--from-json", type=Path, help="re-summarise an earlier run's records, running nothing")
    return ap.parse_args()


def base_bytes(name: str, args: argparse.Namespace, scratch: Path) -> tuple[int, str]:
    if args.base_from.exists():
        m = json.loads(args.base_from.read_text()).get("models", {}).get(name)
        if m and m.get("base_bytes"):
            return int(m["base_bytes"]), f"measured by {args.base_from.name}"
    from memstrata.api.architecture import PRESETS
    from run import idle_interpreter_rss

    return (contenders.planned_base(PRESETS[name], args.seq, args.batch) + idle_interpreter_rss(),
            "planned + an idle interpreter")


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    if args.from_json:
        old = summarize(json.loads(args.from_json.read_text()))
        write_results(old, RESULTS, args.name, markdown, started - old.get("total_seconds", 0.0))
        draw(old, args.name)
        return 0
    from ceiling import measure
    from diskstats import device_of
    from memstrata.api.architecture import PRESETS

    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    backing = device_of(scratch)
    results: dict[str, Any] = {
        "benchmark": "offload-overlap", "machine": machine(scratch), "seq": args.seq, "batch": args.batch,
        "warmup": args.warmup, "measured": args.measured, "backing_device": backing,
        "statistic": f"median over steps {args.warmup + 1}..{args.warmup + args.measured}",
        "fio": measure(scratch, seconds=args.fio_seconds), "models": {}}
    ks = [float(k) for k in args.caps_bytes_per_param.split(",") if k]
    for name in args.models.split(","):
        arch = PRESETS[name]
        base, how = base_bytes(name, args, scratch)
        m = results["models"][name] = {"params": arch.parameters(), "base_bytes": base, "base_from": how,
                                       "caps": [{**c, "runs": []} for c in budget.caps(
                                           base, arch.parameters(), ks, args.all_fits_bytes_per_param)]}
        for i, cap in enumerate(m["caps"]):
            for contender in (PAIR if i % 2 == 0 else PAIR[::-1]):  # alternate who runs first against drift
                cap["runs"].append(contenders.run_contender(
                    contender, arch_name=name, arch=arch, seq=args.seq, batch=args.batch, warmup=args.warmup,
                    measured=args.measured, cap=cap, base=base, scratch=scratch, backing=backing,
                    timeout=args.timeout))
                write_results(summarize(results), RESULTS, args.name, markdown, started)
    draw(results, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
