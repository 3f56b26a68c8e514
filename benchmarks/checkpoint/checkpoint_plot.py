"""The plot beside the checkpoint table: per model, memstrata against stock ZeRO-Infinity (DeepSpeed) as bars:
the checkpoint's write and resume times, their throughput, and the training process's peak RSS during the steps,
during the checkpoint and over the whole job. Draws from the summaries in the JSON (run.summarize's)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from record import pyplot, save_figure

GiB = 1 << 30
ENGINES = {"memstrata": ("memstrata", "tab:blue"), "deepspeed": ("stock ZeRO-Infinity (DeepSpeed)", "tab:orange")}
# (panel title, y label, [(bar group label, summary key, scale)])
PANELS = [
    ("Checkpoint time", "seconds", [("write", "checkpoint_seconds", 1), ("resume", "resume_seconds", 1)]),
    ("Checkpoint throughput", "MB/s (checkpoint bytes / time)",
     [("write", "checkpoint_mb_per_s", 1), ("resume", "resume_mb_per_s", 1)]),
    ("Peak RSS of the training process", "GiB",
     [("steps\n<= ckpt", "peak_rss_training", GiB), ("during\nckpt", "peak_rss_checkpoint", GiB),
      ("whole\njob", "job_peak_rss", GiB)]),
]


def _num(y: float) -> str:
    return f"{y:.2f}" if y < 10 else f"{y:.1f}" if y < 100 else f"{y:.0f}"


def _panel(ax: Any, results: dict[str, Any], title: str, ylabel: str, groups: list[tuple[str, str, int]]) -> None:
    """Bars per (model, group), one per engine; an engine that failed gets a 'failed' mark instead."""
    models = list(results["models"])
    labels = [f"{model}\n{g}" for model in models for g, _, _ in groups]
    width = 0.8 / len(ENGINES)
    for i, (engine, (label, color)) in enumerate(ENGINES.items()):
        xs, ys = [], []
        for j, (model, (_, key, scale)) in enumerate((m, g) for m in models for g in groups):
            s = results["models"][model].get(engine) or {}
            x = j + (i - (len(ENGINES) - 1) / 2) * width
            if not s.get("ok"):
                ax.annotate("failed", (x, 0), ha="center", va="bottom", rotation=90, fontsize="small", color=color)
                continue
            if s.get(key) is not None:
                xs.append(x)
                ys.append(s[key] / scale)
        bars = ax.bar(xs, ys, width, color=color, label=label)
        ax.bar_label(bars, labels=[_num(y) for y in ys], fontsize="x-small", padding=2)
    ax.set_xticks(range(len(labels)), labels, fontsize="small")
    for b in range(1, len(models)):  # between one model's bars and the next's
        ax.axvline(b * len(groups) - 0.5, color="0.7", lw=0.8)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Write the PNG at `path`; None when written, else why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    if not results.get("models"):
        return "no plot: no model"
    n = len(results["models"])
    fig, axes = plt.subplots(1, len(PANELS), figsize=(max(12, 3 + 6 * n), 5.5),
                             gridspec_kw={"width_ratios": [len(g) for _, _, g in PANELS]})
    for ax, (title, ylabel, groups) in zip(axes, PANELS):
        _panel(ax, results, title, ylabel, groups)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncols=len(ENGINES), frameon=False,
               bbox_to_anchor=(0.5, 0.905))
    a, m = results["args"], results["machine"]
    fig.suptitle(f"Checkpoints: memstrata vs stock ZeRO-Infinity, one run each per model\nseq {a['seq']}, "
                 f"{a['steps']} steps, a checkpoint after step {a['every']}, {a.get('precision', 'bf16')}, CPU; "
                 f"{m['cpu']}, {m['cores']} cores, {m['dram_bytes'] / GiB:.1f} GiB")
    save_figure(fig, path, rect=(0, 0, 1, 0.9))
    return None
