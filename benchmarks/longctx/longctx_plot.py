"""The plot beside the long-context table: tokens/s and peak memory against sequence length, a line per contender.

Memory is the device's: the GPU peak where the runs trained on cuda (with the host peak RSS in a third panel), the
worker's peak RSS (VmHWM) on the CPU. A filled marker is a run that completed under the DRAM cap (or with no cap
set); an open one completed only when run again without the cap; a red X on the memory panel is a run the OOM
killer ended under the cap (drawn at the cap); an x on the length axis is a run that failed otherwise (say a GPU
out of memory). Draws from the JSON alone (sweep.measured picks the run that measures each point)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import sweep
from record import pyplot, save_figure

GiB = 1 << 30
COLORS = {"memstrata": "tab:blue", "memstrata-cxl": "tab:cyan", "stock": "tab:orange",
          "stock-ds-cpu-ckpt": "tab:green", "stock-hf-offload": "tab:red"}


def _panels(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(record key, title, y label) of each panel after tokens/s."""
    host = ("peak_rss_bytes", "peak host memory", "host peak RSS, GiB (the worker's VmHWM)")
    gpu = ("gpu_peak_bytes", "peak GPU memory", "GPU peak held (torch reserved + outside it), GiB")
    return [gpu, host] if results.get("device") == "cuda" else [host]


def _failures(results: dict[str, Any], name: str) -> tuple[list[int], list[int]]:
    """Lengths where `name` was OOM-killed under the cap, and where it failed for another reason (not skipped)."""
    oom: list[int] = []
    failed: list[int] = []
    for r in results["runs"]:
        if r["contender"] != name or r.get("ok") or r.get("skipped"):
            continue
        (oom if r.get("oom_killed") else failed).append(r["seq"])
    return oom, failed


def _contender(axes: list[Any], results: dict[str, Any], name: str, color: str, nudge: float) -> None:
    """One contender's line on every panel, its markers saying how each point was measured; its OOM marks sit
    `nudge` (a factor on the length) aside, so two contenders killed at the same length both show."""
    points = [(seq, m) for seq in results["lengths"] if (m := sweep.measured(results["runs"], name, seq))]
    keys = ["tokens_per_second"] + [k for k, _, _ in _panels(results)]
    oom, failed = _failures(results, name)
    label = name + (f" (failed at {', '.join(map(str, failed))})" if failed else "")
    for ax, key in zip(axes, keys):
        scale = 1 if key == "tokens_per_second" else GiB
        pts = [(seq, m[key] / scale, m.get("capped")) for seq, m in points if m.get(key)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, label=label)
        for seq, y, capped in pts:
            uncapped_rerun = not capped and results["dram_cap"].get("enforced")
            ax.plot(seq, y, "o", color=color, markerfacecolor="white" if uncapped_rerun else color, markersize=7)
        if failed:
            ax.plot(failed, [0] * len(failed), "x", color=color, markersize=10, mew=2, clip_on=False)
    cap = results["dram_cap"]
    if oom and cap.get("enforced"):
        host = axes[keys.index("peak_rss_bytes")]
        host.plot([seq * nudge for seq in oom], [cap["bytes"] / GiB] * len(oom), "X", color="red",
                  markeredgecolor=color, markersize=11)


def _legend(ax: Any, results: dict[str, Any]) -> None:
    """The contenders, then what the markers mean."""
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    capped = bool(results["dram_cap"].get("enforced"))
    keys = [Line2D([], [], ls="", marker="o", color="k", label="completed under the cap" if capped else "completed")]
    if capped:
        keys += [Line2D([], [], ls="", marker="o", color="k", markerfacecolor="white",
                        label="completed only without the cap"),
                 Line2D([], [], ls="", marker="X", color="red", label="OOM-killed under the cap (memory panel)")]
    keys.append(Line2D([], [], ls="", marker="x", color="k", mew=2, label="failed (on the length axis)"))
    ax.legend(handles=handles + keys, fontsize="small", loc="best")


def _title(results: dict[str, Any]) -> str:
    mach, cap = results["machine"], results["dram_cap"]
    model = Path(str(results["model"])).name
    cap_txt = f"DRAM cap {cap['bytes'] / GiB:.2f} GiB per run" if cap.get("enforced") else "no DRAM cap"
    return (f"Long context: memstrata vs stock ZeRO-3, {model}, {results['precision']}, micro-batch "
            f"{results['micro_batch']}, on {results['device']} ({mach['cores']} cores); {cap_txt}")


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Write the PNG at `path`; None when written, else why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    names = [c for c in results["contenders"] if c not in results.get("skipped_contenders", {})]
    if not names or not results["lengths"]:
        return "no plot: no contender or no length"
    panels = [("tokens_per_second", "throughput", "tokens/s (median over the steps after the first)")]
    panels += _panels(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    row = list(axes[0])
    for i, name in enumerate(names):
        _contender(row, results, name, COLORS.get(name, f"C{i}"), 1.025 ** (i - (len(names) - 1) / 2))
    cap = results["dram_cap"]
    for ax, (key, title, ylabel) in zip(row, panels):
        ax.set(xscale="log", xlabel="sequence length, tokens", ylabel=ylabel, title=title)
        ax.set_xticks(results["lengths"], [str(n) for n in results["lengths"]])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if key == "peak_rss_bytes" and cap.get("enforced"):
            ax.axhline(cap["bytes"] / GiB, color="red", ls=":", lw=1)
            ax.annotate("DRAM cap", (0.01, cap["bytes"] / GiB), xycoords=("axes fraction", "data"),
                        textcoords="offset points", xytext=(0, 3), color="red", fontsize="small")
    _legend(row[0], results)
    fig.suptitle(_title(results))
    save_figure(fig, path)
    return None
