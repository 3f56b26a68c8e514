"""The plot beside benchmarks/results/operator.md: create-to-pod latency of memstrata's operator against the
Kubernetes Job controller under one burst, as distributions (the fraction of objects with a pod by each second
after their create) where operator.json holds every object's latency; results written before it did hold only
p50, mean, p99 and max, drawn as bars. The p99 target is marked; the burst's wall time is beside them."""
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


def _distributions(ax: Any, r: dict[str, Any]) -> None:
    """Each latency's empirical distribution: x seconds after its create, y the fraction of objects seen by then."""
    for label, s, color in _series(r):
        xs = s["samples_s"]
        n = len(xs) + s.get("missing", 0)  # an object never seen never reaches the curve's top
        ax.step(xs, [(i + 1) / n for i in range(len(xs))], where="post", color=color, label=f"{label} (p99 "
                f"{s['p99_s']:.1f} s)")
    target = (r.get("targets") or {}).get("p99_to_pod_created_s")
    if target:
        ax.axvline(target, color="red", ls=":", lw=1, label=f"target: memstrata's p99 to pod < {target:g} s")
    ax.axhline(0.99, color="0.6", ls="--", lw=0.8)
    ax.set(xlabel="seconds from the create response", ylabel="fraction of the burst's objects", ylim=(0, 1.02))
    ax.legend(fontsize="small", loc="lower right")
    ax.grid(alpha=0.3)


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
    if all("samples_s" in s for _, s, _ in _series(r)):
        _distributions(left, r)
        left.set_title("latency from create, every object (dashed: 99% of them)")
    else:
        _latencies(left, r)
        left.set_title("latency from create (these results hold only these statistics, not each object's latency)")
    _wall(right, r)
    cpus = (r.get("machine") or {}).get("cpus", "?")
    fig.suptitle(f"memstrata operator vs Kubernetes Job controller: {r['jobs']} objects created at once, "
                 f"{r['nodes']} kwok nodes, one control plane on {cpus} CPUs")
    save_figure(fig, path)
    return None
