"""The arithmetic of the offload-at-every-budget benchmark: caps, the bisection of each contender's floor (the
smallest cap it completes under), step statistics, bounds, the best stock configuration and the targets. Pure
functions over numbers and the run records, so a results file can be re-summarised (`run.py --from-json`) and
every rule tested without training anything.
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

# Issue 31's targets (ratios from one run): floor, speed against stock, the overlapped bound, all-DRAM speed and
# memory against stock CPU offload.
TARGET_FLOOR_RATIO = 0.45  # memstrata's floor k <= this x the smallest k at which any stock configuration completes
TARGET_STOCK_RATIO = 0.6  # memstrata's step <= this x the best stock configuration's, at every cap where both run
TARGET_BOUND_RATIO = 1.15  # memstrata's step <= this x max(compute, I/O) where the I/O exceeds compute
TARGET_SPEED_VS_CPU = 0.95  # all in DRAM: memstrata's speed >= this x stock CPU offload's
TARGET_MEMORY_VS_CPU = 0.75  # ... at <= this x its peak host memory
# The bisection stops once [highest failing k, lowest passing k] is at most the larger of these.
FLOOR_RESOLUTION = 0.5  # bytes per parameter
FLOOR_RELATIVE = 0.10  # of the lowest passing k
CRASH_TRIES = 2  # runs at a k whose run crashed (not short of memory) before the bisection stops there
# Failures that say "needs more memory": the cgroup's OOM kill, an allocation refused, the planner refusing the
# cap. Anything else (a crash, a timeout) is an error, which stops that contender's bisection.
SHORT_OF_MEMORY = ("oom", "enomem", "refused")
ENOMEM_SIGNS = ("MemoryError", "Cannot allocate memory")
# The cap at which every all-DRAM contender fits, the all-DRAM comparison's: stock CPU offload holds 20 B/param of
# state (16-bit weights and gradients 2 + 2, fp32 gradient partitions 4, master 4, Adam moments 8) against
# memstrata's 16, so at 20 it was OOM-killed on gpt-350m (no all-DRAM comparison at all) and passed gpt-125m by
# 0.14 GiB; 4 B/param more leaves it room for its transients.
ALL_FITS_BYTES_PER_PARAM = 24.0
BASE_FORMULA = ("cap = base + k x parameters; base = the peak RSS of memstrata with everything in DRAM (a probe run "
                "under a cap far above it) minus 16 B/param (16-bit weights 2 + gradients 2 + fp32 master and Adam "
                "moments 12): what a run holds beside its state (interpreter, transformers, DeepSpeed's ops, "
                "activations, allocator slack). Where the probe fails: working_set + build_transient "
                "(memstrata.plan.accounting) + the idle interpreter's RSS")
BOUND_FORMULA = ("I/O = read bytes / fio read B/s + write bytes / fio write B/s (median bytes per measured step on "
                 "the backing disk, from /proc/diskstats); compute = the median step of the fastest all-DRAM run of "
                 "the model at the all-fits cap; overlapped bound = max(compute, I/O) (the target's), serial bound "
                 "= compute + I/O")
STOCK = ("stock-default", "stock-tuned", "stock-cpu")
DELAYED = "memstrata-delayed"  # contenders.DELAYED: the delayed update, asked for by name
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


def outcome(run: dict[str, Any]) -> str:
    """Why a run ended: 'ok'; 'oom' (killed by the OOM killer under its cap), 'enomem' (a Python MemoryError or
    ENOMEM), 'refused' (memstrata's planner says the cap cannot hold the job: contenders.run_contender records
    `refused`, or 'no plan: ...' where the planner or stratamap raised), 'skipped'; else 'error' (a crash, a
    timeout)."""
    if run.get("ok"):
        return "ok"
    if run.get("skipped"):
        return "skipped"
    if run.get("oom_killed"):
        return "oom"
    err = run.get("error") or ""
    if run.get("refused") or err.startswith("no plan:"):
        return "refused"
    return "enomem" if any(s in err for s in ENOMEM_SIGNS) else "error"


def next_k(tried: list[tuple[float, str]], top: float = ALL_FITS_BYTES_PER_PARAM, bottom: float = 0.0,
           resolution: float = FLOOR_RESOLUTION, relative: float = FLOOR_RELATIVE) -> float | None:
    """The next k (bytes per parameter over the base) to try for one contender, given its (k, outcome) so far, or
    None when done. The all-fits k `top` runs first and must pass (else the floor is above all-fits); `bottom` is
    assumed failing unless measured. Then the midpoint of [highest failing k, lowest passing k] until that interval
    is at most max(resolution, relative x the lowest passing k). An outcome that is neither 'ok' nor short of
    memory (a crash, a timeout) is run once more at its k (`CRASH_TRIES`: a stock run once died at exit with
    "terminate called without an active exception"); crashing again stops the bisection: more memory is not
    known to help. Each k is judged by its last run."""
    runs = Counter(k for k, _ in tried)
    tried = list(dict(tried).items())  # the last outcome at each k, in the order the ks were first tried
    crashed = [k for k, o in tried if o != "ok" and o not in SHORT_OF_MEMORY]
    if crashed:
        return crashed[0] if runs[crashed[0]] < CRASH_TRIES else None
    if not any(k == top for k, _ in tried):
        return top
    passing = [k for k, o in tried if o == "ok"]
    if not passing:
        return None
    hi = min(passing)
    lo = max((k for k, o in tried if o != "ok" and k < hi), default=bottom)
    if hi - lo <= max(resolution, relative * hi):
        return None
    return round((lo + hi) / 2, 3)


def floor_of(probes: list[dict[str, Any]], top: float = ALL_FITS_BYTES_PER_PARAM) -> dict[str, Any]:
    """One contender's floor from its bisection's runs (each with its 'k'): k (the lowest passing k, None unless
    found), status ('found', 'above all-fits', 'error', 'open': the bisection did not finish), the highest k
    below it that failed and why, and [k, outcome] per probe in the order run."""
    every = [(float(p["k"]), outcome(p)) for p in probes]
    last = {float(p["k"]): p for p in probes}  # each k judged by its last run (a crash is retried once)
    tried = [(k, outcome(p)) for k, p in last.items()]
    passing = [k for k, o in tried if o == "ok"]
    hi = min(passing, default=None)
    below = [(k, last[k]) for k, o in tried if o != "ok" and (hi is None or k < hi)]
    failed = max(below, key=lambda kp: kp[0], default=None)
    crash = next((last[k] for k, o in tried if o == "error"), None)
    if crash is not None:
        status, why = "error", f"stopped at k={crash['k']:g}: {_last_line(crash.get('error'))}"
    elif (not any(k == top for k, _ in tried) or next_k(tried, top) is not None) and (hi is None or failed is None):
        status, why = "open", "bisection not finished"
    elif next_k(tried, top) is not None:  # the probes ran out with a passing k above a failing one
        status = "bounded"
        why = (f"between k={failed[0]:g} ({outcome(failed[1])}) and k={hi:g} (ran): the probes ran out before the "
               "resolution")
    elif hi is None:
        status, why = "above all-fits", f"fails at the all-fits k={top:g}: {_last_line(failed[1].get('error'))}" \
            if failed else "no run"
    else:
        status = "found"
        why = f"k={failed[0]:g} failed: {outcome(failed[1])}: {_last_line(failed[1].get('error'))}" if failed \
            else "passes at every k tried"
    monotone = all(o == "ok" for k, o in tried if hi is not None and k > hi)
    return {"k": hi if status in ("found", "bounded") else None, "upper_k": hi, "status": status, "reason": why,
            "failing_k": failed[0] if failed else None, "monotone": monotone, "tried": [[k, o] for k, o in every]}


def _last_line(text: str | None) -> str:
    return ((text or "").strip().splitlines()[-1:] or [""])[0][:160]


def floor_ratio(model: dict[str, Any], top: float = ALL_FITS_BYTES_PER_PARAM) -> dict[str, Any]:
    """memstrata's floor k / the smallest floor k of any stock configuration, or ratio None and why. A stock
    configuration whose bisection errored or did not finish leaves the ratio unknown; one that fails even at
    all-fits has its floor above `top`: where every stock one does, the ratio is memstrata's k / top, an upper
    bound ('upper_bound')."""
    floors = {n: f["floor"] for n, f in (model.get("floors") or {}).items()}
    ours = floors.get("memstrata")
    out: dict[str, Any] = {"ratio": None, "memstrata_k": ours and ours["k"], "stock_k": None, "stock": None,
                           "upper_bound": False}
    stock = {n: f for n, f in floors.items() if n in STOCK}
    unsettled = [f"{n}: {f['status']} ({f['reason']})" for n, f in stock.items()
                 if f["status"] not in ("found", "bounded", "above all-fits")]
    if not ours or ours["k"] is None:
        out["why"] = f"memstrata: {ours['status']} ({ours['reason']})" if ours else "memstrata not bisected"
    elif not stock or unsettled:
        out["why"] = "; ".join(unsettled) or "no stock configuration bisected"
    if "why" in out or ours is None:
        return out
    k = float(ours["k"])
    # A stock floor only bounded lies above its failing k: that k makes the ratio an upper bound (memstrata's own
    # k is its lowest passing one either way).
    found = {n: f["k"] if f["status"] == "found" else f["failing_k"] for n, f in stock.items()
             if f["status"] in ("found", "bounded")}
    if found:
        best = min(found, key=lambda n: found[n])
        out.update(stock=best, stock_k=found[best], ratio=_ratio(k, found[best]),
                   upper_bound=stock[best]["status"] == "bounded")
    else:
        out.update(stock="none (all above all-fits)", stock_k=top, ratio=_ratio(k, top), upper_bound=True)
    return out


def step_bound(step: float, io_s: float, compute: float | None) -> dict[str, Any]:
    """A step against what its I/O and compute allow: overlapped = max(compute, I/O) (the engines overlap
    transfers with compute), serial = compute + I/O; ratio = step / overlapped. Without a compute floor the
    bound is the I/O alone and `io_bound` is unknown."""
    over = max(compute, io_s) if compute is not None else io_s
    serial = io_s + (compute or 0.0)
    return {"io_seconds": round(io_s, 4), "compute_seconds": compute, "overlapped_seconds": round(over, 4),
            "serial_seconds": round(serial, 4), "io_bound": None if compute is None else io_s > compute,
            "ratio": round(step / over, 3) if over else None,
            "serial_ratio": round(step / serial, 3) if serial else None}


def measure_ks(floors: dict[str, dict[str, Any]], top: float = ALL_FITS_BYTES_PER_PARAM,
               resolution: float = FLOOR_RESOLUTION) -> list[float]:
    """The ks of the full runs: from memstrata's floor (or the lowest floor found, if it has none) through every
    stock floor above it to the all-fits k; where no stock floor lies between, the midpoint. ks closer than
    `resolution` to a kept one are dropped."""
    found = {n: f["k"] for n, f in floors.items() if f["k"] is not None and f["k"] < top}
    start = found.get("memstrata", min(found.values(), default=None))
    if start is None:
        return [top]
    between = sorted(k for n, k in found.items() if start < k < top)
    ks = [start, *(between or [round((start + top) / 2, 3)])]
    kept: list[float] = []
    for k in ks:
        if not kept or k - kept[-1] >= resolution:
            kept.append(k)
    return [k for k in kept if top - k >= resolution] + [top]


def fits_at(floors: dict[str, dict[str, Any]], k: float) -> list[str]:
    """The contenders known to complete at or below k: their lowest passing k (their floor, or where a crash or the
    probe limit ended the bisection, the lowest k that passed), in the order they were bisected."""
    lowest = {n: f.get("upper_k", f["k"]) for n, f in floors.items()}
    return [n for n, low in lowest.items() if low is not None and low <= k + 1e-9]


def param_reads(run: dict[str, Any], backing: str) -> tuple[int | None, str]:
    """Parameter bytes read per measured step and what they are: memstrata's swap layer's 'param' counter (median
    per step) where the harness recorded it; else every read on the backing disk (stock cannot tell its parameter
    reads from its optimizer's)."""
    if run.get("param_read_bytes") is not None:
        return int(run["param_read_bytes"]), "param (engine counter)"
    io = (run.get("io") or {}).get(backing)
    what = "all reads (no engine counter)" if run["contender"].startswith("memstrata") else \
        "all reads (params + optimizer)"
    return (int(io["read_bytes"]), what) if io else (None, "")


def targets(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 31's targets for one model, each with its measured ratio, limit and pass/fail (None: not measurable)."""
    fr = model.get("floor_ratio") or floor_ratio(model)
    out = [_target(f"floor: memstrata's k <= {TARGET_FLOOR_RATIO}x the smallest k at which any stock configuration "
                   "completes" + (" (stock above all-fits: an upper bound)" if fr.get("upper_bound") else ""),
                   fr["ratio"], TARGET_FLOOR_RATIO, le=True, note=fr.get("why"))]
    out += _speed_targets(model, "memstrata", "vs_best_stock", "memstrata")
    out += _speed_targets(model, DELAYED, "delayed_vs_best_stock", "memstrata with the delayed update (by name)")
    fits = next((c for c in model["caps"] if c["all_fits"]), None)
    r, cpu = (_run(fits, "memstrata"), _run(fits, "stock-cpu")) if fits else (None, None)
    pair = bool(r and r.get("ok") and cpu and cpu.get("ok"))
    speed = _ratio(cpu["step"]["median"], r["step"]["median"]) if pair else None  # type: ignore[index]
    mem = _ratio(host_peak(r), host_peak(cpu)) if pair else None  # type: ignore[arg-type]
    out.append(_target(f"all in DRAM: memstrata speed >= {TARGET_SPEED_VS_CPU}x stock CPU offload's", speed,
                       TARGET_SPEED_VS_CPU, le=False))
    out.append(_target(f"all in DRAM: memstrata peak host memory <= {TARGET_MEMORY_VS_CPU}x stock CPU offload's",
                       mem, TARGET_MEMORY_VS_CPU, le=True))
    return out


def _speed_targets(model: dict[str, Any], name: str, ratio_key: str, who: str) -> list[dict[str, Any]]:
    """The speed and bound targets of one memstrata flavour (`name`'s runs, their ratios under `ratio_key`)."""
    budget = [c for c in model["caps"] if not c["all_fits"]]
    vs = [(c["k"], c[ratio_key]["step_ratio"]) for c in budget if c.get(ratio_key)]
    worst = max(vs, key=lambda kv: kv[1], default=None)
    out = [_target(f"speed: {who} step <= {TARGET_STOCK_RATIO}x the best stock configuration's at every cap where "
                   "both run (all-fits aside)", worst and worst[1], TARGET_STOCK_RATIO, le=True,
                   note=worst and f"worst at k={worst[0]:g}")]
    ours = [(c["k"], r["bound"]) for c in budget for r in [_run(c, name)] if r and r.get("bound")
            and (name != DELAYED or delayed_ran(r))]
    io_bound = [(k, b["ratio"]) for k, b in ours if b["io_bound"]]
    worst = max(io_bound, key=lambda kv: kv[1], default=None)
    out.append(_target(f"bound: where I/O exceeds compute, {who} step <= {TARGET_BOUND_RATIO}x max(compute, I/O)",
                       worst and worst[1], TARGET_BOUND_RATIO, le=True,
                       note=(f"worst at k={worst[0]:g}" if worst else "no cap where I/O exceeds compute"
                             if model.get("compute_floor") else "no compute floor")))
    return out


def delayed_ran(run: dict[str, Any]) -> bool:
    """Whether a run's updates did run delayed (refused, e.g. with weights on NVMe, each ran in place, exact)."""
    overlap = (run.get("swap") or {}).get("updateOverlap") or {}
    return bool(overlap.get("on")) and overlap.get("mode") == "delayed"


def _target(text: str, measured: float | None, limit: float, *, le: bool, note: str | None = None
            ) -> dict[str, Any]:
    ok = None if measured is None else (measured <= limit if le else measured >= limit)
    return {"target": text, "measured": measured, "limit": limit, "pass": ok, "note": note}


def summarize_model(model: dict[str, Any], fio: dict[str, Any], backing: str) -> dict[str, Any]:
    """Fill in the derived fields of one model's record in place: each contender's floor and the floor ratio, per
    cap the best stock run and memstrata's ratios to it, per run the bounds (I/O bytes on the backing disk over
    fio's bandwidth, against the compute floor: overlapped and serial), and the targets."""
    for f in (model.get("floors") or {}).values():
        f["floor"] = floor_of(f["probes"], model.get("all_fits_k", ALL_FITS_BYTES_PER_PARAM))
    model["floor_ratio"] = floor_ratio(model, model.get("all_fits_k", ALL_FITS_BYTES_PER_PARAM))
    fits = next((c for c in model["caps"] if c["all_fits"]), None)
    floor = compute_floor(fits["runs"]) if fits else None
    model["compute_floor"] = {"seconds": floor[0], "from": floor[1]} if floor else None
    for cap in model["caps"]:
        for run in cap["runs"]:
            io = (run.get("io") or {}).get(backing)
            if run.get("ok") and io and fio:
                io_s = io_seconds(io, fio["read_bytes_per_s"], fio["write_bytes_per_s"])
                run["bound"] = step_bound(run["step"]["median"], io_s, floor[0] if floor else None)
        best = best_stock(cap["runs"])
        cap["best_stock"] = best["contender"] if best else None
        for name, key in (("memstrata", "vs_best_stock"), (DELAYED, "delayed_vs_best_stock")):
            ours = _run(cap, name)
            if ours and ours.get("ok") and name == DELAYED and not delayed_ran(ours):
                cap["delayed_refused"] = (ours.get("swap") or {}).get("updateOverlap", {}).get("refused") or "off"
                ours = None  # it ran in place: the exact engine's run, not the delayed update's
            if best and ours and ours.get("ok"):
                cap[key] = {"step_ratio": _ratio(ours["step"]["median"], best["step"]["median"]),
                            "memory_ratio": _ratio(host_peak(ours), host_peak(best))}
            else:
                cap.pop(key, None)
    model["targets"] = targets(model)
    return model
