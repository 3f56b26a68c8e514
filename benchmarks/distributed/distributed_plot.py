"""The plot beside the ranks-on-one-node table: per engine, tokens/s and peak DRAM against the number of ranks
(1 rank x gradient accumulation 2, 2 ranks x 1: the same global batch). Peak DRAM is the RSS of the whole process
tree of `memstrata run` (solid), with the plan's DRAM for the node (dashed). The engines run at different DRAM
budgets (stock DeepSpeed's pools would not fit memstrata's), so the lines compare ranks within an engine."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from record import pyplot, save_figure

GiB = 1 << 30
COLORS = {"memstrata": "tab:blue", "deepspeed": "tab:orange"}
GA = {1: 2, 2: 1}  # ranks -> gradient accumulation (run.LAYOUTS)


def _points(engine: dict[str, Any], key: str, scale: float = 1) -> list[tuple[int, float]]:
    """(ranks, value) of the layouts that completed and recorded `key`."""
    out = []
    for ranks in sorted(int(k) for k in engine if k.isdigit()):
        s = engine[str(ranks)]
        if s.get("ok") and s.get(key) is not None:
            out.append((ranks, s[key] / scale))
    return out


def _line(ax: Any, pts: list[tuple[int, float]], color: str, style: str, label: str) -> None:
    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label, markersize=7)
    for x, y in pts:  # outside the lines: left of the first point, right of the others
        left = x == min(p[0] for p in pts) and len(pts) > 1
        ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(-8 if left else 8, 0), va="center",
                    ha="right" if left else "left", fontsize="small")


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Write the PNG at `path`; None when written, else why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    engines = results.get("engines") or {}
    if not engines:
        return "no plot: no engine"
    fig, (tps, mem) = plt.subplots(1, 2, figsize=(13, 5.5))
    ranks: set[int] = set()
    for i, (name, e) in enumerate(engines.items()):
        color = COLORS.get(name, f"C{i}")
        label = f"{name} (DRAM budget {e.get('dram_budget')})"
        failed = [k for k in ("1", "2") if k in e and not e[k].get("ok")]
        if failed:
            label += f", failed at {' and '.join(failed)} rank(s)"
        pts = _points(e, "tokens_per_second")
        ranks |= {r for r, _ in pts}
        _line(tps, pts, color, "o-", label)
        _line(mem, _points(e, "tree_peak_rss_bytes", GiB), color, "o-", f"{name}: process tree peak RSS")
        _line(mem, _points(e, "plan_dram_bytes", GiB), color, "s--", f"{name}: plan DRAM")
    for ax in (tps, mem):
        ticks = sorted(ranks) or [1, 2]
        ax.set_xticks(ticks, [f"{r} rank{'s' if r > 1 else ''}\n(x GA {GA.get(r, '?')})" for r in ticks])
        ax.set_xlim(min(ticks) - 0.5, max(ticks) + 0.5)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the lines
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    tps.set(title="throughput", xlabel="ranks on one node (gradient accumulation)",
            ylabel="tokens/s (steps after the first)")
    mem.set(title="peak host DRAM", xlabel="ranks on one node (gradient accumulation)", ylabel="GiB")
    a, m = results["args"], results["machine"]
    fig.suptitle(f"Ranks on one node, same global batch {a.get('global_batch', 2)}: 1 rank vs 2, per engine (compare "
                 f"within an engine: the DRAM budgets differ)\n{a['model']}, seq {a['seq']}, {a['steps']} steps, "
                 f"{a.get('precision', 'bf16')}, CPU; {m['cpu']}, {m['cores']} cores, {m['dram_bytes'] / GiB:.1f} GiB")
    save_figure(fig, path)
    return None
