"""The Markdown of the long-context results (from the JSON alone, so --from-json can rebuild it)."""
from __future__ import annotations

from typing import Any

import sweep

MiB = 1 << 20


def _mib(n: int | None) -> str:
    return f"{n / MiB:,.0f}" if n else ""


def _x(r: float | None) -> str:
    return f"{r:.2f}" if r is not None else ""


def _under_cap(results: dict[str, Any], name: str, seq: int) -> str:
    if not results["dram_cap"].get("enforced"):
        return "no cap"
    r = sweep.capped_run(results["runs"], name, seq)
    if r is not None and r.get("skipped"):
        return f"not tried ({r['error'].rsplit(': ', 1)[-1]})"
    return sweep.outcome(r) if r is not None else ""


def _row(results: dict[str, Any], name: str, seq: int) -> str:
    runs = results["runs"]
    m = sweep.measured(runs, name, seq)
    head = f"| {seq} | {name} | {_under_cap(results, name, seq)} |"
    if m is None:
        last: dict[str, Any] = next((r for r in reversed(runs) if r["contender"] == name and r["seq"] == seq), {})
        err = (last.get("error") or "not run").splitlines()[-1][:140]
        return f"{head} {sweep.outcome(last) if last else ''}: {err} |" + " |" * 9
    vs = (results["summary"]["memstrata_over"].get(str(seq)) or {}).get(name) or {}
    act = m.get("activations") or {}
    pool = f"{act.get('stratum')} {_mib(act.get('livePeakBytes'))}" if act else ""
    steps = " / ".join(f"{t:.0f}" for t in m["step_tokens_per_second"])
    cpu = m.get("cpu_seconds_per_step")
    return (f"{head} {'capped' if m['capped'] else 'no cap'} | {m['tokens_per_second']:.1f} ({steps}) | "
            f"{f'{cpu:.1f}' if cpu else ''} | {_mib(m['peak_rss_bytes'])} | {_mib(m.get('cgroup_peak_bytes'))} | "
            f"{_mib(m.get('gpu_peak_bytes'))} | {pool} | {_x(vs.get('tokens_per_second'))} | "
            f"{_x(vs.get('cpu_seconds_per_step'))} | {_x(vs.get('peak_rss'))} |")


def markdown(results: dict[str, Any]) -> str:
    mach, cap = results["machine"], results["dram_cap"]
    names = [c for c in results["contenders"] if c not in results["skipped_contenders"]]
    lines = [f"# Long context: memstrata vs stock ZeRO-3 ({results['model']}, micro-batch {results['micro_batch']}, "
             f"{results['precision']}, {results['steps']} steps per run, {results['device']}, {mach['cores']} cores)",
             "", f"![tokens/s and peak memory against sequence length]({results.get('name', 'longctx')}.png)", "",
             f"DRAM cap per run: {cap['bytes'] / 2**30:.2f} GiB, "
             + (f"enforced by {cap['mechanism']}." if cap.get("enforced") else f"not enforced: {cap.get('why_not')}.")
             + f" {results['statistic']}. memstrata's loss chunk: {results['loss_chunk_tokens']} tokens. Load "
               f"average at start {results['loadavg_start']}, at end {results.get('loadavg_end')}.", ""]
    lines += [f"- {n}: {results['what'][n]}" for n in results["contenders"]]
    lines += [f"- {n}: {why}" for n, why in results["skipped_contenders"].items()]
    lines += ["", "| seq | contender | under the cap | measured | tokens/s (each step) | CPU s/step | peak RSS MiB | "
              "cgroup peak MiB | GPU peak MiB | checkpoint pool (peak MiB) | memstrata / this: tokens/s | CPU s/step | "
              "peak RSS |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(results, n, seq) for seq in results["lengths"] for n in names]
    pairs = [v for row in results["summary"]["memstrata_over"].values() for v in row.values()]
    if pairs:
        lines += ["", "Losses, memstrata against every other contender at the same length (same model, seed and data): "
                      f"largest difference at step 1 {max(v['loss_first_abs_diff'] for v in pairs):.2e}, at any step "
                      f"{max(v['loss_max_abs_diff'] for v in pairs):.2e} (later steps start from bf16 weights updated "
                      "with gradients summed in another order)."]
    longest = results["summary"]["longest_under_cap"]
    if longest:
        lines += ["", f"Longest length completed under the {cap['bytes'] / 2**30:.2f} GiB cap (every shorter one "
                      "completed too):", "", "| contender | longest |", "|---|---|"]
        lines += [f"| {n} | {longest[n] if longest[n] is not None else 'none'} |" for n in names]
    return "\n".join(lines) + "\n"
