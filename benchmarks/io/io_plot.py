"""The plot beside benchmarks/results/io.md: throughput per case for every contender against fio (the reference),
and the page-locked host memory of memstrata against DeepSpeed's ZeRO-3 NVMe swap pools per model. Draws from
io.json alone; either half may be missing (benchmarks/io/run.py and pinned.py each write theirs)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from record import pyplot, save_figure

MiB, GiB = 1 << 20, 1 << 30
# fio last and grey: the reference the others are held to.
CONTENDERS = {"memstrata": "tab:blue", "memstrata-threads": "tab:cyan", "deepspeed": "tab:orange", "fio": "0.55"}
LABELS = {"memstrata": "memstrata (io_uring)", "memstrata-threads": "memstrata (thread fallback)",
          "deepspeed": "DeepSpeed aio", "fio": "fio (reference)"}


def _case_label(row: dict[str, Any]) -> str:
    return f"{row['op']}\n{row['block_bytes'] // MiB} MiB, QD {row['queue_depth']}"


def _throughput(ax: Any, out: dict[str, Any]) -> None:
    """Grouped bars: per case, each contender's median GiB/s, the whiskers its runs' lowest and highest."""
    cases = out["cases"]
    names = [n for n in CONTENDERS if any(n in row["gib_per_s"] for row in cases)]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(cases))]
        med = [row["gib_per_s"].get(name, 0.0) for row in cases]
        runs = [row.get("samples_gib_per_s", {}).get(name) or [m] for row, m in zip(cases, med)]
        spread = [[m - min(s) for m, s in zip(med, runs)], [max(s) - m for m, s in zip(med, runs)]]
        ax.bar(xs, med, width, yerr=spread, capsize=2, color=CONTENDERS[name], label=LABELS[name],
               hatch="//" if name == "fio" else None, edgecolor="black", linewidth=0.4)
    ax.set_xticks(range(len(cases)), [_case_label(r) for r in cases])
    ax.set_ylabel("GiB/s (median; whiskers: lowest and highest run)")
    ax.set_title(f"Throughput, {out['bytes_per_run'] // MiB} MiB per run, median of {out['runs']} runs; "
                 "fio on the same loop device is the reference")
    ax.legend(ncols=len(names), loc="upper left", fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def _pinned(ax: Any, pinned: dict[str, Any]) -> None:
    """Per model (computed, and measured VmLck where allocated): locked GiB of both, memstrata / DeepSpeed below."""
    from matplotlib.ticker import FuncFormatter

    cases = pinned["cases"]
    labels = [f"{c['model']}\n{'measured' if c['source'].startswith('measured') else 'computed'}\n"
              f"ratio {c['ratio_vs_deepspeed']:.2f}" for c in cases]
    xs = list(range(len(cases)))
    for side, (key, label, color) in zip((-0.2, 0.2), (
            ("memstrata_bytes", "memstrata (peak of its two locked pools)", CONTENDERS["memstrata"]),
            ("deepspeed_bytes", "DeepSpeed ZeRO-3 NVMe swap pools", CONTENDERS["deepspeed"]))):
        ys = [c[key] / GiB for c in cases]
        bars = ax.bar([x + side for x in xs], ys, 0.4, color=color, label=label)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize="x-small", padding=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xticks(xs, labels)
    ax.set_ylabel("page-locked GiB (log scale)")
    ax.set_title(f"Pinned host memory per model, ratio = memstrata / DeepSpeed (target: {pinned['target']})")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.margins(y=0.15)


def plot(out: dict[str, Any], path: Path) -> str | None:
    """Write the PNG at `path`; None when written, else why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    halves = [h for h in ("cases", "pinned") if out.get(h)]
    if not halves:
        return "no plot: io.json has neither throughput cases nor pinned memory"
    fig, axes = plt.subplots(len(halves), 1, figsize=(14, 5.5 * len(halves)), squeeze=False)
    for ax, half in zip(axes[:, 0], halves):
        if half == "cases":
            _throughput(ax, out)
        else:
            _pinned(ax, out["pinned"])
    m = out.get("machine") or {}
    where = (f"{m['cpu']}, {m['cores']} cores, {m.get('memory_gib', '?')} GiB, kernel {m.get('kernel', '?')}"
             if m else "machine not recorded")
    fig.suptitle(f"benchmarks/io: memstrata vs DeepSpeed aio vs fio, on {where}")
    save_figure(fig, path)
    return None
