"""The plot beside the offload-at-every-budget table: per model, step time and peak host memory against k (bytes
per parameter over the base) for each contender, each contender's floor marked. Needs matplotlib; where it does
not import, `plot` says so and draws nothing (it is no dependency of the benchmark)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from budget import host_peak
from record import pyplot, save_figure


def series(model: dict[str, Any]) -> dict[str, list[tuple[float, float, float]]]:
    """{contender: [(k, median step s, peak host GiB)]} over the finished full runs, by k."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for cap in model["caps"]:
        for r in cap["runs"]:
            if r.get("ok"):
                out.setdefault(r["contender"], []).append((float(cap["k"]), r["step"]["median"],
                                                           host_peak(r) / (1 << 30)))
    return {n: sorted(v) for n, v in out.items()}


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Write the PNG at `path`; None when written, else why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    models = results["models"]
    if not models:
        return "no plot: no model"
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, (name, m) in enumerate(models.items()):
        step_ax, mem_ax = axes[0][col], axes[1][col]
        for i, (contender, pts) in enumerate(series(m).items()):
            color = f"C{i}"
            step_ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=contender)
            mem_ax.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=color, label=contender)
            floor = ((m.get("floors") or {}).get(contender) or {}).get("floor") or {}
            if floor.get("k") is not None:
                for ax in (step_ax, mem_ax):
                    ax.axvline(floor["k"], color=color, linestyle=":", linewidth=1)
        step_ax.set(title=f"{name}: step time (dotted: each engine's floor)", ylabel="median step s")
        mem_ax.set(xlabel="k = (cap - base) / parameters, B/param", ylabel="peak host GiB (cgroup)")
        step_ax.legend(fontsize="small")
    mach = results.get("machine") or {}
    fig.suptitle(f"Offload at every DRAM budget: memstrata vs stock ZeRO-Infinity (seq {results.get('seq')}, batch "
                 f"{results.get('batch')}, {'GPU' if results.get('gpu') else 'CPU'}); {mach.get('cpu', '?')}, "
                 f"{mach.get('cores', '?')} cores")
    save_figure(fig, path)
    return None
