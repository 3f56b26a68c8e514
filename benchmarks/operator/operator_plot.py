"""The plot beside benchmarks/results/operator.md: create-to-pod latency of memstrata's operator against the
Kubernetes Job controller under one burst. operator.json keeps only summary statistics per controller (p50, mean,
p99, max), not each object's latency, so those are drawn as bars (the title says so), with the p99 target; the
burst's wall time is beside them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from record import pyplot, save_figure

STATS = (("p50_s", "p50"), ("mean_s", "mean"), ("p99_s", "p99"), ("max_s", "max"))


def _series(r: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(label, summary, colour) of every latency the JSON holds."""
    m, j = r["memstrata"], r["job_controller"]
    out = [("memstrata operator: create -> pod created", m["to_pod_created"], "tab:blue")]
    if m.get("to_first_phase"):
        out.append(("memstrata operator: create -> first status.phase", m["to_first_phase"], "tab:cyan"))
    out.append(("Job controller: create -> pod created", j["to_pod_created"], "0.55"))
    return out


def _latencies(ax: Any, r: dict[str, Any]) -> None:
    series = _series(r)
    width = 0.8 / len(series)
    for i, (label, s, color) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(STATS))]
        ys = [s.get(key) for key, _ in STATS]
        missing = f", {s['missing']} never seen" if s.get("missing") else ""
        bars = ax.bar(xs, [y or 0 for y in ys], width, color=color, label=label + missing)
        ax.bar_label(bars, labels=[f"{y:.1f}" if y is not None else "" for y in ys], fontsize="x-small", padding=2)
    target = (r.get("targets") or {}).get("p99_to_pod_created_s")
    if target:
        ax.axhline(target, color="red", ls=":", lw=1, label=f"target: memstrata's p99 to pod < {target:g} s")
    ax.set_xticks(range(len(STATS)), [name for _, name in STATS])
    ax.set(xlabel="statistic over the objects of the burst", ylabel="seconds from the create response")
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)


def _wall(ax: Any, r: dict[str, Any]) -> None:
    names = ["memstrata\noperator", "Job\ncontroller"]
    walls = [r["memstrata"]["burst_wall_s"], r["job_controller"]["burst_wall_s"]]
    bars = ax.bar(names, walls, color=["tab:blue", "0.55"], width=0.6)
    ax.bar_label(bars, labels=[f"{w:.1f}" for w in walls], fontsize="small", padding=2)
    ax.set(ylabel="seconds, first create to last pod seen", title="burst wall time")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)


def plot(r: dict[str, Any], path: Path) -> str | None:
    """Write the PNG at `path`; None when written, else why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [4, 1]})
    _latencies(left, r)
    _wall(right, r)
    left.set_title("latency from create (operator.json stores only these statistics, not each object's latency)")
    cpus = (r.get("machine") or {}).get("cpus", "?")
    fig.suptitle(f"memstrata operator vs Kubernetes Job controller: {r['jobs']} objects created at once, "
                 f"{r['nodes']} kwok nodes, one control plane on {cpus} CPUs")
    save_figure(fig, path)
    return None
