"""The Markdown of the offload-at-every-budget results (from the JSON alone, so --from-json can rebuild it)."""
from __future__ import annotations

from typing import Any

from budget import param_reads

G = 1 << 30
M = 1 << 20


def _g(n: int | None) -> str:
    return f"{n / G:.2f}" if n is not None else ""


def _f(x: float | None, fmt: str = ".3f") -> str:
    return format(x, fmt) if x is not None else ""


def _run_row(model: str, cap: dict[str, Any], r: dict[str, Any], backing: str) -> str:
    head = f"| {model} | {cap['k']:g}{' (all fits)' if cap['all_fits'] else ''} | {_g(cap['bytes'])} | {r['contender']}"
    if not r.get("ok"):
        why = "OOM" if r.get("oom_killed") else ("skipped" if r.get("skipped") else
                                                 "refused" if r.get("refused") else "FAILED")
        err = ((r.get("error") or "").splitlines()[-1:] or [""])[0].removeprefix(f"{why}: ")
        return f"{head} | {why}: {err[:110]} |" + " |" * 14
    s, ph = r["step"], r["phases"]
    io = (r.get("io") or {}).get(backing) or {}
    b = r.get("bound") or {}
    cg = (r.get("cgroup") or {}).get("peak_bytes")
    param, what = param_reads(r, backing)
    return (f"{head} | yes | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} ({s['p25']:.2f}-{s['p75']:.2f}) | "
            f"{ph['forward']:.2f} / {ph['backward']:.2f} / {ph['update']:.2f} | "
            f"{_f(io.get('read_bytes') and io['read_bytes'] / M, '.0f')} / "
            f"{_f(io.get('write_bytes') and io['write_bytes'] / M, '.0f')} | "
            f"{_f(param and param / M, '.0f')}{f' ({what})' if param is not None else ''} | "
            f"{_f(b.get('io_seconds'), '.2f')} | {_f(b.get('compute_seconds'), '.2f')} | "
            f"{_f(b.get('overlapped_seconds'), '.2f')} | {_f(b.get('ratio'), '.2f')} | "
            f"{_f(b.get('serial_seconds'), '.2f')} | {_f(b.get('serial_ratio'), '.2f')} | "
            f"{_g(r['peak_rss_bytes'])} | {_g(cg)} | {r['init_seconds']:.1f} |")


def _floor_rows(model: str, m: dict[str, Any]) -> list[str]:
    rows = []
    for name, f in (m.get("floors") or {}).items():
        fl = f.get("floor") or {}
        probes = ", ".join(f"{k:g}: {o}" for k, o in fl.get("tried", []))
        k = fl.get("k")
        cap = int(m["base_bytes"] + k * m["params"]) if k is not None else None
        odd = "" if fl.get("monotone", True) else " (NOT monotone: a higher k failed)"
        rows.append(f"| {model} | {name} | {_f(k, 'g')} | {_g(cap)} | {fl.get('status', '')} | {probes} | "
                    f"{fl.get('reason', '')}{odd} |")
    fr = m.get("floor_ratio")
    if fr and m.get("floors"):
        rows.append(f"| {model} | floor_ratio | {_f(fr['ratio'])}{' (upper bound)' if fr['upper_bound'] else ''} | | "
                    f"memstrata {_f(fr['memstrata_k'], 'g')} / {fr['stock'] or ''} {_f(fr['stock_k'], 'g')} | | "
                    f"{fr.get('why') or ''} |")
    return rows


def _plan_row(model: str, cap: dict[str, Any]) -> str | None:
    r = next((x for x in cap["runs"] if x["contender"] == "memstrata"), None)
    if not r or not r.get("plan"):
        return None
    p = r["plan"]
    loop = next((v for d, v in (r.get("io") or {}).items() if d.startswith("loop")), None)
    wire = (r.get("swap") or {})
    return (f"| {model} | {cap['k']:g} | {_g(p['dram_budget_bytes'])} | {'yes' if p['feasible'] else 'no'} | "
            f"{_g(p['bytes_on']['dram'])} | {_g(p['bytes_on']['nvme'])} | {' / '.join(p['offload_devices'])} | "
            f"{_f(loop and loop['read_bytes'] / M, '.0f')} / {_f(loop and loop['write_bytes'] / M, '.0f')} | "
            f"{'; '.join(p['shortfalls'])[:120]} | {'status recorded' if wire else ''} |")


def markdown(results: dict[str, Any]) -> str:
    mach, fio = results["machine"], results.get("fio") or {}
    backing = results["backing_device"]
    cap = results["dram_cap"]
    lines = [f"# Offload at every DRAM budget: memstrata vs stock ZeRO-Infinity (seq {results['seq']}, batch "
             f"{results['batch']}, {results['precision']}, {results['warmup']} warm-up + "
             f"{results['measured']} measured "
             f"steps, CPU, {mach['cores']} cores)", "",
             f"![step time and peak host memory against the cap, each engine's floor dotted]"
             f"({results.get('name', 'offload-budget')}.png)", "",
             f"Caps: {results['base_formula']}. Idle interpreter RSS: {_g(results['idle_interpreter_rss_bytes'])} GiB "
             f"(charged to a fresh cgroup: {_g(results.get('idle_interpreter_cgroup_peak_bytes'))} GiB). "
             + (f"Enforced by {cap['mechanism']}." if cap.get("enforced") else f"NOT enforced: {cap.get('why_not')}."),
             f"Scratch {mach['scratch']} ({mach['scratch_fs']}) on /dev/{backing}; fio: read "
             f"{fio.get('read_bytes_per_s', 0) / M:.0f} MB/s, write {fio.get('write_bytes_per_s', 0) / M:.0f} MB/s "
             f"through a file (loop device over it: read {fio.get('loop_read_bytes_per_s', 0) / M:.0f}, write "
             f"{fio.get('loop_write_bytes_per_s', 0) / M:.0f}).", f"Bound: {results['bound_formula']}.",
             f"Step times: {results['statistic']}.", "",
             f"Floors: {results.get('floor_rule', 'not bisected (explicit caps)')}.", "",
             "| model | contender | floor k B/param | cap GiB | status | probes (k: outcome) | reason |",
             "|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        lines += _floor_rows(name, m)
    lines += ["", "| model | k B/param | cap GiB | contender | ok | step s (median) | min-max (p25-p75) | "
              f"fwd / bwd / update s | {backing} MiB/step read / write | parameter MiB read/step | I/O s | "
              "compute s | overlapped bound s (max) | step / overlapped | serial bound s (sum) | step / serial | "
              "peak RSS GiB | cgroup peak GiB | init s |", "|---" * 19 + "|"]
    for name, m in results["models"].items():
        for c in m["caps"]:
            lines += [_run_row(name, c, r, backing) for r in c["runs"]]
    lines += ["", "Per cap, memstrata (exact; and with the delayed update a job asks for by name) vs the best stock "
              "configuration that finished (fastest median step):", "",
              "| model | k | best stock | memstrata step / best | memstrata peak RSS / best | delayed step / best | "
              "delayed peak RSS / best |", "|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        for c in m["caps"]:
            vs, dl = c.get("vs_best_stock") or {}, c.get("delayed_vs_best_stock") or {}
            delayed = (f"in place: {c['delayed_refused'][:60]} | |" if c.get("delayed_refused") else
                       f"{_f(dl.get('step_ratio'))} | {_f(dl.get('memory_ratio'))} |")
            lines.append(f"| {name} | {c['k']:g} | {c.get('best_stock') or 'none finished'} | "
                         f"{_f(vs.get('step_ratio'))} | {_f(vs.get('memory_ratio'))} | {delayed}")
    lines += ["", "memstrata's plan at each cap (bytes per stratum, the devices DeepSpeed is given, the loop device's "
              "own counters per step):", "",
              "| model | k | DRAM budget GiB | feasible | plan DRAM GiB | plan NVMe GiB | param / optim device | "
              "loop MiB/step read / write | shortfalls | engine status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        lines += [row for c in m["caps"] if (row := _plan_row(name, c))]
    lines += ["", "Targets (issue 31; ratios from this one run):", "",
              "| model | target | measured | limit | pass | note |", "|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        floor = m.get("compute_floor")
        for t in m.get("targets", []):
            ok = {True: "pass", False: "FAIL", None: "n/a"}[t["pass"]]
            lines.append(f"| {name} | {t['target']} | {_f(t['measured'])} | {t['limit']} | {ok} | "
                         f"{t.get('note') or ''} |")
        floor_text = f"{floor['seconds']:.2f} s ({floor['from']})" if floor else "none (no all-DRAM run finished)"
        lines.append(f"| {name} | compute floor | {floor_text} | | | |")
    lines += ["", f"Load average at start {results['loadavg_start']}, end {results.get('loadavg_end')} (shared "
              f"machine); total {results.get('total_seconds', 0) / 60:.1f} min. Peak host memory in the targets is "
              "what the run's cgroup was charged at its peak (each page once; the process tree's RSS, also shown, "
              "counts shared library pages in every process)."]
    return "\n".join(lines) + "\n"
