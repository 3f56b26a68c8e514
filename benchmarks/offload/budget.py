"""The arithmetic of the offload-at-every-budget benchmark: caps, step statistics, bounds, the best stock
configuration and the targets. Pure functions over numbers and the run records, so a results file can be
re-summarised (`run.py --from-json`) and every rule tested without training anything.
"""
from __future__ import annotations

import statistics
from typing import Any

# Item 5's targets, over caps base + 2.2 .. base + 16 bytes/param, and one cap where everything fits in DRAM.
TARGET_BOUND_RATIO = 1.25
TARGET_STOCK_RATIO = 0.6
TARGET_MEMORY_VS_TUNED = 0.40
TARGET_SPEED_VS_CPU = 0.9
TARGET_MEMORY_VS_CPU = 0.75
ALL_FITS_BYTES_PER_PARAM = 20.0
BASE_FORMULA = ("cap = base + k x parameters; base = the peak RSS of memstrata with everything in DRAM (a probe run "
                "under a cap far above it) minus 16 B/param (16-bit weights 2 + gradients 2 + fp32 master and Adam "
                "moments 12): what a run holds beside its state (interpreter, transformers, DeepSpeed's ops, "
                "activations, allocator slack). Where the probe fails: working_set + build_transient "
                "(memstrata.plan.accounting) + the idle interpreter's RSS")
STOCK = ("stock-default", "stock-tuned", "stock-cpu")
ALL_DRAM = ("stock-cpu", "memstrata")  # the runs whose median step is the compute floor (at the all-fits cap)


def caps(base_bytes: int, params: int, per_param: list[float], all_fits: float = ALL_FITS_BYTES_PER_PARAM
         ) -> list[dict[str, Any]]:
    """The caps of one model, smallest first, the all-fits one last: {k, bytes, all_fits}."""
    out = [{"k": k, "bytes": int(base_bytes + k * params), "all_fits": False} for k in sorted(per_param)]
    return out + [{"k": all_fits, "bytes": int(base_bytes + all_fits * params), "all_fits": True}]


def spread(values: list[float]) -> dict[str, float]:
    """Median and spread (min, p25, p75, max) of measured step times."""
    if not values:
        raise ValueError("no measured steps")
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "p25": q[0], "p75": q[2],
            "max": max(values)}


def step_io(steps: list[dict[str, list[int]]], device: str, warmup: int) -> dict[str, int] | None:
    """Median bytes read and written per measured step on `device`, from the harness's per-step diskstats."""
    rows = [s[device] for s in steps[warmup:] if device in s]
    if not rows:
        return None
    return {"read_bytes": int(statistics.median(r[0] for r in rows)),
            "write_bytes": int(statistics.median(r[1] for r in rows))}


def io_seconds(io: dict[str, int], read_bw: float, write_bw: float) -> float:
    """The pure I/O bound of a step: bytes read / read bandwidth + bytes written / write bandwidth (B/s)."""
    return io["read_bytes"] / read_bw + io["write_bytes"] / write_bw


def compute_floor(runs: list[dict[str, Any]]) -> tuple[float, str] | None:
    """(median step, contender) of the fastest finished all-DRAM run at the all-fits cap."""
    done = [r for r in runs if r.get("ok") and r["contender"] in ALL_DRAM]
    if not done:
        return None
    best = min(done, key=lambda r: r["step"]["median"])
    return best["step"]["median"], best["contender"]


def best_stock(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest (median step) stock run that finished at this cap; skipped and failed runs never count."""
    done = [r for r in runs if r.get("ok") and r["contender"] in STOCK]
    return min(done, key=lambda r: r["step"]["median"]) if done else None


def host_peak(run: dict[str, Any]) -> int:
    """Peak host memory of a run: what its cgroup was charged at the peak (each page once: anonymous memory, the
    locked pools, the page cache its own I/O made, which direct I/O keeps small), the number the cap enforces;
    the process tree's peak RSS where no cgroup peak was read. (The tree's RSS, also recorded, counts shared
    library pages in every process and ran above the cap it was never killed at.)"""
    peak = (run.get("cgroup") or {}).get("peak_bytes")
    return int(peak) if peak else int(run["peak_rss_bytes"])


def _run(cap: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in cap["runs"] if r["contender"] == name), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Item 5's targets for one model, each with its measured ratio and pass/fail (None: not measurable)."""
    budget = [c for c in model["caps"] if not c["all_fits"]]
    fits = next((c for c in model["caps"] if c["all_fits"]), None)
    ours = [(c, _run(c, "memstrata")) for c in budget]
    out = []
    ran = [r for _, r in ours if r and r.get("ok")]
    oom = [c["k"] for c, r in ours if r and r.get("oom_killed")]
    out.append({"target": "memstrata never OOMs at any cap from base + 2.2 to base + 16 B/param",
                "measured": f"{len(ran)}/{len(ours)} ran" + (f", OOM at k={oom}" if oom else ""),
                "pass": len(ran) == len(ours) and not oom})
    bound = [r.get("bound", {}).get("ratio") for r in ran]
    worst = max((b for b in bound if b is not None), default=None)
    out.append({"target": f"memstrata step <= {TARGET_BOUND_RATIO}x the bandwidth bound at every cap",
                "measured": worst, "limit": TARGET_BOUND_RATIO,
                # Without the compute floor the bound is I/O alone, a bound no step can meet: not judged.
                "pass": None if worst is None or None in bound or not model.get("compute_floor")
                else worst <= TARGET_BOUND_RATIO})
    vs = [c.get("vs_best_stock", {}).get("step_ratio") for c, r in ours if r and r.get("ok") and c.get("best_stock")]
    worst = max((v for v in vs if v is not None), default=None)
    out.append({"target": f"memstrata step <= {TARGET_STOCK_RATIO}x the best stock configuration that fits, "
                          "at every cap (a cap where no stock run finished counts as met)",
                "measured": worst, "limit": TARGET_STOCK_RATIO,
                "pass": (len(ran) == len(ours)) and (worst is None or worst <= TARGET_STOCK_RATIO)})
    both = [(c, r, t) for c, r in ours if r and r.get("ok")
            for t in [_run(c, "stock-tuned")] if t and t.get("ok")]
    mem = _ratio(host_peak(both[0][1]), host_peak(both[0][2])) if both else None
    out.append({"target": f"peak host memory <= {TARGET_MEMORY_VS_TUNED}x stock-tuned's at the smallest cap where "
                          "both run", "measured": mem, "limit": TARGET_MEMORY_VS_TUNED,
                "at_k": both[0][0]["k"] if both else None,
                "pass": None if mem is None else mem <= TARGET_MEMORY_VS_TUNED})
    r, cpu = (_run(fits, "memstrata"), _run(fits, "stock-cpu")) if fits else (None, None)
    pair = r and r.get("ok") and cpu and cpu.get("ok")
    speed = _ratio(cpu["step"]["median"], r["step"]["median"]) if pair else None  # type: ignore[index]
    mem = _ratio(host_peak(r), host_peak(cpu)) if pair else None  # type: ignore[arg-type]
    out.append({"target": f"all in DRAM: memstrata speed >= {TARGET_SPEED_VS_CPU}x stock CPU offload's",
                "measured": speed, "limit": TARGET_SPEED_VS_CPU,
                "pass": None if speed is None else speed >= TARGET_SPEED_VS_CPU})
    out.append({"target": f"all in DRAM: memstrata host memory <= {TARGET_MEMORY_VS_CPU}x stock CPU offload's",
                "measured": mem, "limit": TARGET_MEMORY_VS_CPU,
                "pass": None if mem is None else mem <= TARGET_MEMORY_VS_CPU})
    return out


def summarize_model(model: dict[str, Any], fio: dict[str, Any], backing: str) -> dict[str, Any]:
    """Fill in the derived fields of one model's record in place: per cap the best stock run and memstrata's
    ratios to it, per run the bandwidth bound (I/O bytes on the backing disk over fio's bandwidth, plus the
    compute floor), and the targets."""
    fits = next((c for c in model["caps"] if c["all_fits"]), None)
    floor = compute_floor(fits["runs"]) if fits else None
    model["compute_floor"] = {"seconds": floor[0], "from": floor[1]} if floor else None
    for cap in model["caps"]:
        for run in cap["runs"]:
            io = (run.get("io") or {}).get(backing)
            if run.get("ok") and io and fio:
                pure = io_seconds(io, fio["read_bytes_per_s"], fio["write_bytes_per_s"])
                total = pure + (floor[0] if floor else 0.0)
                run["bound"] = {"io_seconds": round(pure, 4), "seconds": round(total, 4),
                                "includes_floor": floor is not None,
                                "ratio": round(run["step"]["median"] / total, 3) if total else None}
        best = best_stock(cap["runs"])
        cap["best_stock"] = best["contender"] if best else None
        ours = _run(cap, "memstrata")
        if best and ours and ours.get("ok"):
            cap["vs_best_stock"] = {"step_ratio": _ratio(ours["step"]["median"], best["step"]["median"]),
                                    "memory_ratio": _ratio(host_peak(ours), host_peak(best))}
        else:
            cap.pop("vs_best_stock", None)
    model["targets"] = targets(model)
    return model
