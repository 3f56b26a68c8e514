"""benchmarks/gpu/check.py's results as a table, the targets memstrata is held to, and a plot."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GiB = 1 << 30


def _gib(v: Any) -> str:
    from memstrata.api.units import format_bytes

    return format_bytes(int(v)) if isinstance(v, (int, float)) and v else "-"


def _losses(r: dict[str, Any]) -> str:
    losses = r.get("losses") or []
    return f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"


def table(results: dict[str, Any]) -> list[str]:
    lines = [f"# memstrata GPU check ({results['profile']}: {results.get('gpu') or 'no GPU'})", "",
             f"![memstrata vs stock ZeRO-Infinity on the GPU]({results.get('name', 'gpu-check')}.png)", "",
             "| item | engine | DRAM budget | status | tok/s | peak RSS | plan DRAM | HBM peak | "
             "loss first -> last | s | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["items"].items():
        tps = f"{r['tokens_per_second']:,.0f}" if r.get("tokens_per_second") else "-"
        detail = r.get("summary") or r.get("verdict") or r.get("error") or ""
        note = "; ".join(x for x in (r.get("note"), detail.splitlines()[-1][:160] if detail else "") if x)
        lines.append(f"| {name} | {r.get('engine') or '-'} | {r.get('budget') or '-'} | {r.get('status')} | {tps} | "
                     f"{_gib(r.get('peak_rss_bytes'))} | {_gib(r.get('plan_dram_bytes'))} | "
                     f"{_gib(r.get('hbm_peak_bytes'))} | {_losses(r)} | {r.get('seconds', '-')} | {note} |")
    return lines


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def targets(results: dict[str, Any], profile: Any) -> list[tuple[str, str, bool | None]]:
    """(target, what was measured, met: True/False, None where it could not be judged)."""
    items = results["items"]
    get = lambda name: items.get(name) or {}  # noqa: E731
    m, s = get(f"memstrata-{profile.big}"), get(f"stock-{profile.big}")
    out: list[tuple[str, str, bool | None]] = []
    speed = _ratio(m.get("tokens_per_second"), s.get("tokens_per_second"))
    out.append((f"{profile.big}: memstrata >= 2.5x stock's tokens/s", f"{speed:.2f}x" if speed else "not measured",
                speed >= 2.5 if speed else None))
    d = get(f"memstrata-{profile.big}-delayed")
    fast = _ratio(d.get("tokens_per_second"), s.get("tokens_per_second"))
    ran = (d.get("update") or {}).get("mode") == "delayed" and (d.get("update") or {}).get("on")
    out.append((f"{profile.big}: memstrata with the delayed update (by name) >= 2.5x stock's tokens/s",
                (f"{fast:.2f}x" + ("" if ran else f" (refused: {(d.get('update') or {}).get('refused')})"))
                if fast else "not measured", fast >= 2.5 if fast and ran else None))
    rss, plan = m.get("peak_rss_bytes"), m.get("plan_dram_bytes")
    out.append((f"{profile.big}: memstrata's peak host memory <= its plan's DRAM + 2 GiB",
                f"{_gib(rss)} vs {_gib(plan)} + 2 GiB" if rss and plan else "not measured",
                rss <= plan + 2 * GiB if rss and plan else None))
    only, refused = get(f"memstrata-{profile.only_memstrata}"), get(f"stock-{profile.only_memstrata}")
    out.append((f"{profile.only_memstrata}: memstrata trains where stock's plan does not fit",
                f"memstrata {only.get('status', 'not run')}, stock {refused.get('status', 'not run')}",
                (only.get("ok") and refused.get("ok")) if only and refused else None))
    ml, sl = get("memstrata-long"), get("stock-long")
    hbm = _ratio(ml.get("hbm_peak_bytes"), sl.get("hbm_peak_bytes"))
    out.append(("long context: memstrata's HBM peak below stock's", f"{hbm:.2f}x" if hbm else "not measured",
                hbm < 1 if hbm else None))
    tps = _ratio(ml.get("tokens_per_second"), sl.get("tokens_per_second"))
    out.append(("long context: memstrata >= 0.9x stock's tokens/s", f"{tps:.2f}x" if tps else "not measured",
                tps >= 0.9 if tps else None))
    for name, what in (("memstrata-fp16", "fp16"), ("memstrata-lora", "LoRA")):
        r = get(name)
        losses = r.get("losses") or []
        out.append((f"{what} trains with falling loss", _losses(r) if losses else r.get("status", "not run"),
                    losses[-1] < losses[0] if len(losses) > 1 and r.get("ok") else (False if r.get("status") == "failed"
                                                                                    else None)))
    e = get("memstrata-export")
    ran = e.get("status") in ("completed", "failed")
    out.append(("the exported model reloads with the engine's validation loss",
                f"{e.get('reloaded_validation_loss')} vs {e.get('engine_validation_loss')}" if ran
                else e.get("status", "not run"), e.get("ok") if ran else None))
    return out


def write(results: dict[str, Any], out: Path, profile: Any) -> None:
    # The targets are an H100's; on the CPU (a tiny model, 2 cores) they are shown, never judged.
    judged = profile.gpus > 0
    results["targets"] = [{"target": t, "measured": m, "met": ok if judged else None}
                          for t, m, ok in targets(results, profile)]
    name = profile.result_name
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    verdict = {True: "met", False: "MISSED", None: "not judged" if judged else "not judged on the CPU"}
    lines = table(results) + ["", "| target | measured | |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {verdict[t['met']]} |" for t in results["targets"]]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    plot(results, out / f"{name}.png")


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Tokens/s and peak host memory per run, beside each other; skipped (saying why) where matplotlib is not
    installed or nothing ran."""
    from record import pyplot, save_figure

    plt = pyplot()
    if isinstance(plt, str):
        return plt
    runs = [(n, r) for n, r in results["items"].items() if r.get("tokens_per_second")]
    if not runs:
        return "no plot: no run measured tokens/s"
    names = [n for n, _ in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(runs) + 2))
    colors = ["tab:blue" if r.get("engine") == "memstrata" else "tab:gray" for _, r in runs]
    left.barh(names, [r["tokens_per_second"] for _, r in runs], color=colors)
    left.set_xlabel("tokens/s (steps after the first)")
    right.barh(names, [(r.get("peak_rss_bytes") or 0) / GiB for _, r in runs], color=colors, label="peak RSS")
    right.scatter([(r.get("plan_dram_bytes") or 0) / GiB for _, r in runs], names, color="black", marker="|", s=200,
                  label="plan DRAM", zorder=3)
    right.set_xlabel("GiB of host memory")
    right.legend(loc="lower right")
    for ax in (left, right):
        ax.invert_yaxis()
    cores = (results.get("machine") or {}).get("cores")
    fig.suptitle(f"memstrata (blue) vs stock ZeRO-Infinity (grey): {results.get('gpu') or results['profile']}"
                 + (f", {cores} cores" if cores else ""))
    save_figure(fig, path)
    return None
