"""The plan as a picture (`memstrata plan --svg FILE`): where a job's bytes go, per category and stratum, against
each stratum's capacity. Pure: a Plan in, SVG text out; no plotting library (the operator image has none).

One bar per stratum, as wide as its capacity, filled by the categories placed on it; a stratum asked for more
than it has is drawn to the bytes asked, with its capacity marked in red. Each stratum is scaled to its own
capacity: HBM in GiB and NVMe in TiB side by side would leave the small ones invisible.
"""
from __future__ import annotations

from xml.sax.saxutils import escape

from memstrata.api.strata import titles
from memstrata.api.strataplan import Plan
from memstrata.api.units import format_bytes

WIDTH = 1060
LABEL_W, BAR_W, ROW_H, BAR_H = 150, 520, 54, 28
TOP = 86
# Colour-blind-safe (Okabe-Ito), then greys: categories beyond eight are rare.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999", "#666666")
OVER = "#C0392B"


def _text(x: float, y: float, text: str, *, size: int = 13, anchor: str = "start", weight: str = "normal",
          fill: str = "#222") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{fill}">{escape(text)}</text>')


def _row(plan: Plan, index: int, colours: dict[str, str]) -> list[str]:
    """One stratum's bar: its categories' segments, its capacity, what is used of it."""
    use = plan.strata[index]
    name, y = use.stratum, TOP + index * ROW_H
    asked = plan.bytes_on(name)
    scale_to = max(use.capacity, asked)
    out = [_text(10, y + BAR_H / 2 + 5, titles().get(name, name), weight="bold"),
           f'<rect x="{LABEL_W}" y="{y}" width="{BAR_W}" height="{BAR_H}" fill="#f2f2f2" stroke="#bbb"/>']
    x = float(LABEL_W)
    for c in plan.categories:
        n = c.on(name)
        if not n or not scale_to:
            continue
        w = max(BAR_W * n / scale_to, 1.0)
        out.append(f'<rect class="segment" data-stratum="{escape(name)}" data-category="{escape(c.category)}" '
                   f'data-bytes="{n}" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{BAR_H}" '
                   f'fill="{colours[c.category]}"><title>{escape(c.description)}: {format_bytes(n)} on '
                   f'{escape(titles().get(name, name))}</title></rect>')
        x += w
    if asked > use.capacity and scale_to:
        cap_x = LABEL_W + BAR_W * use.capacity / scale_to
        out.append(f'<line class="capacity" x1="{cap_x:.2f}" y1="{y - 4}" x2="{cap_x:.2f}" y2="{y + BAR_H + 4}" '
                   f'stroke="{OVER}" stroke-width="3"/>')
    if use.capacity == 0 and asked == 0:
        said, fill = "none on this node", "#888"
    elif asked > use.capacity:
        said, fill = f"{format_bytes(asked)} asked of {format_bytes(use.capacity)}: over by " \
                     f"{format_bytes(asked - use.capacity)}", OVER
    else:
        said, fill = f"{format_bytes(asked)} of {format_bytes(use.capacity)} ({100 * asked / use.capacity:.0f}%)", "#222"
    out.append(_text(LABEL_W + BAR_W + 12, y + BAR_H / 2 + 5, said, fill=fill))
    return out


def _legend(plan: Plan, colours: dict[str, str], y: float) -> list[str]:
    out = [_text(10, y, "categories (bytes on the node, all strata)", weight="bold")]
    for i, c in enumerate(plan.categories):
        col, row = i % 2, i // 2
        lx, ly = 10 + col * (WIDTH / 2), y + 14 + row * 22
        out.append(f'<rect x="{lx}" y="{ly}" width="14" height="14" fill="{colours[c.category]}"/>')
        out.append(_text(lx + 20, ly + 12, f"{c.description}: {format_bytes(c.bytes)}", size=12))
    return out


def render_svg(plan: Plan, title: str) -> str:
    """The picture, as a standalone SVG document."""
    colours = {c.category: PALETTE[i % len(PALETTE)] for i, c in enumerate(plan.categories)}
    legend_y = TOP + len(plan.strata) * ROW_H + 20
    height = legend_y + 30 + ((len(plan.categories) + 1) // 2) * 22 + 10
    verdict = "fits" if plan.feasible else "does not fit"
    body = [_text(10, 26, title, size=17, weight="bold"),
            _text(10, 48, f"{plan.parameters:,} parameters · engine {plan.engine} · {plan.world_size} "
                          f"rank{'s' if plan.world_size != 1 else ''} · each bar is one stratum, as wide as its "
                          "capacity", size=12, fill="#555"),
            _text(10, 68, f"verdict: {verdict}", size=13, weight="bold", fill="#1a7f37" if plan.feasible else OVER)]
    for i in range(len(plan.strata)):
        body += _row(plan, i, colours)
    body += _legend(plan, colours, legend_y)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
            f'viewBox="0 0 {WIDTH} {height:.0f}" font-family="sans-serif">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")
