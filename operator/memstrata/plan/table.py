"""The plan as a table for people (`memstrata plan`). Pure: a Plan in, text out."""
from __future__ import annotations

from memstrata.api.units import format_bytes
from memstrata.api.strataplan import STRATA, STRATUM_NAMES, Plan


def render_plan(plan: Plan, title: str) -> str:
    rows = [("category", "bytes", *[STRATUM_NAMES[s] for s in STRATA])]
    for c in plan.categories:
        rows.append((c.description, format_bytes(c.bytes), *[_cell(c.on(s)) for s in STRATA]))
    rows.append(("total", format_bytes(sum(c.bytes for c in plan.categories)),
                 *[_cell(plan.bytes_on(s)) for s in STRATA]))
    rows.append(("capacity", "", *[_cell(u.capacity) for u in plan.strata]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = "  ".join("-" * w for w in widths)

    def fmt(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [title, f"parameters: {plan.parameters:,}   engine: {plan.engine}", "", fmt(rows[0]), line]
    out += [fmt(r) for r in rows[1:-2]] + [line] + [fmt(r) for r in rows[-2:]] + [""]
    for u in plan.strata:
        if u.detail:
            out.append(f"{STRATUM_NAMES[u.stratum]}: {u.detail}")
    if plan.requests:
        out.append("requests: " + ", ".join(f"{k}={v}" for k, v in sorted(plan.requests.items())))
    if plan.update_io_seconds:
        out.append(f"estimated NVMe time per optimizer step: {plan.update_io_seconds:.2f} s")
    out.append(f"verdict: {'fits' if plan.feasible else 'does not fit'}")
    out += [f"  - {s.message}" for s in plan.shortfalls]
    return "\n".join(out)


def _cell(n: int) -> str:
    return format_bytes(n) if n else "-"
