"""Renders benchmarks/results/io.md from io.json (throughput table and pinned-memory table), and io.png beside it
(io_plot).

Both benchmark scripts write their half of io.json and then call render(), so the
Markdown and the plot always show whatever the JSON holds, never a stale copy of one half.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from io_plot import plot
from record import draw

MiB = 1 << 20
GiB = 1 << 30


def _throughput(out: dict[str, Any]) -> list[str]:
    lines = ["## Throughput", "",
             "| op | block | QD | memstrata GiB/s | fio GiB/s | DeepSpeed GiB/s | vs fio | vs DeepSpeed "
             "| thread path GiB/s (vs fio) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in out["cases"]:
        g = row["gib_per_s"]
        ds = f"{g['deepspeed']:.2f}" if "deepspeed" in g else "n/a"
        vds = f"{row['ratio_vs_deepspeed']:.2f}" if row["ratio_vs_deepspeed"] else "n/a"
        threads = (f"{g['memstrata-threads']:.2f} ({row['threads_ratio_vs_fio']:.2f})"
                   if "memstrata-threads" in g else "not measured")
        lines.append(f"| {row['op']} | {row['block_bytes'] // MiB} MiB | {row['queue_depth']} | "
                     f"{g['memstrata']:.2f} | {g['fio']:.2f} | {ds} | {row['ratio_vs_fio']:.2f} | {vds} | {threads} |")
    m = out["machine"]
    loads = out.get("load_average_1_5_15_before_and_after_each_run") or []
    load_txt = (f" 1-minute load average during the runs: {min(x[0] for x in loads):.2f} to "
                f"{max(x[0] for x in loads):.2f} (shared machine)." if loads else "")
    note = out.get("deepspeed_note")
    lines += ["", f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}; loop device over a "
              f"file on {m['backing_filesystem']['source']} ({m['backing_filesystem']['fstype']}), direct I/O on; "
              f"DeepSpeed {m.get('deepspeed') or 'n/a'} aio on a second fully written file on the same disk; "
              f"{out['bytes_per_run'] // MiB} MiB per run, median of {out['runs']}, contenders rotated every run."
              + load_txt + (f" {note}" if note else ""),
              ""]
    above = [r for r in out["cases"] if r["ratio_vs_fio"] > 1.1]
    if above:  # says so rather than letting a ratio above 1 pass as headroom
        lines += [f"In {len(above)} of {len(out['cases'])} cases memstrata beat fio by more than 10%: on this loop device "
                  "fio is not the ceiling there (its per-run samples in io.json vary as much as the gap).", ""]
    lines += ["fio command (per case; `<loopdev>` is the loop device): `" + out["cases"][0]["fio_command"] + "`"]
    return lines


def _pinned(p: dict[str, Any]) -> list[str]:
    lines = ["## Pinned (page-locked) host memory", "",
             "| model | source | memstrata locked (peak) | DeepSpeed ZeRO-3 NVMe locked | ratio "
             "| memstrata peak by phase |",
             "|---|---|---|---|---|---|"]
    for row in p["cases"]:
        phases = (row.get("memstrata") or {}).get("peak_by_phase") or {}
        by_phase = ", ".join(f"{k} {v / GiB:.3f}" for k, v in phases.items())
        lines.append(f"| {row['model']} | {row['source']} | {row['memstrata_bytes'] / GiB:.3f} GiB | "
                     f"{row['deepspeed_bytes'] / GiB:.3f} GiB | {row['ratio_vs_deepspeed']:.3f} | {by_phase} |")
    load = p.get("loadavg_1_5_15")
    lines += ["", p["method"], "", f"Target: {p['target']}." + (f" Load average (1/5/15 min) when done: {load}." if load else "")]
    return lines


def render(res_dir: Path) -> str:
    out = json.loads((res_dir / "io.json").read_text())
    lines = ["# benchmarks/io", "", "![I/O throughput against fio, and pinned host memory against DeepSpeed](io.png)",
             ""]
    if "cases" in out:
        lines += _throughput(out) + [""]
    if "pinned" in out:
        lines += _pinned(out["pinned"]) + [""]
    text = "\n".join(lines)
    (res_dir / "io.md").write_text(text)
    png = res_dir / "io.png"
    print(draw(plot, out, png) or f"wrote {png}")
    return text
