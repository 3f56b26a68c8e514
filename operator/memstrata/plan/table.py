"""The plan as a table for people (`memstrata plan`). Pure: a Plan in, text out."""
from __future__ import annotations

from memstrata.api.strata import titles
from memstrata.api.strataplan import Plan
from memstrata.api.units import format_bytes


def render_plan(plan: Plan, title: str) -> str:
    # A distributed job gets a "per rank" column and row beside the node's bytes: one training process's share.
    spread = plan.world_size > 1
    # One column per stratum of the plan (the planner lists every registered one), in the plan's order.
    strata, label = [u.stratum for u in plan.strata], titles()
    rows = [("category", *(("per rank", "per node") if spread else ("bytes",)), *[label.get(s, s) for s in strata])]
    for c in plan.categories:
        rows.append((c.description, *_sizes(spread, c.rank_bytes, c.bytes), *[_cell(c.on(s)) for s in strata]))
    rows.append(("total", *_sizes(spread, sum(c.rank_bytes for c in plan.categories),
                                  sum(c.bytes for c in plan.categories)),
                 *[_cell(plan.bytes_on(s)) for s in strata]))
    blank = ("", "") if spread else ("",)
    if spread:
        rows.append(("per rank", *blank, *[_cell(plan.rank_bytes.get(s, 0)) for s in strata]))
    rows.append(("capacity", *blank, *[_cell(u.capacity) for u in plan.strata]))
    footer = 3 if spread else 2
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = "  ".join("-" * w for w in widths)

    def fmt(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    trainable = (f"   trainable: {plan.trainable_parameters:,} (LoRA adapters)"
                 if plan.trainable_parameters is not None else "")
    out = [title, f"parameters: {plan.parameters:,}{trainable}   engine: {plan.engine}", world_line(plan)]
    if spread:
        out.append(f"per rank: one training process; per node: its {_ranks(plan.ranks_per_node)} on this node")
    out += ["", fmt(rows[0]), line]
    out += [fmt(r) for r in rows[1:-footer]] + [line] + [fmt(r) for r in rows[-footer:]] + [""]
    for u in plan.strata:
        if u.detail:
            out.append(f"{label.get(u.stratum, u.stratum)}: {u.detail}")
    if plan.requests:
        out.append("requests: " + ", ".join(f"{k}={v}" for k, v in sorted(plan.requests.items())))
    out += [f"note: {n}" for n in plan.notes]
    if plan.update_io_seconds:
        out.append(f"estimated NVMe time per optimizer step: {plan.update_io_seconds:.2f} s")
    out.append(f"verdict: {'fits' if plan.feasible else 'does not fit'}")
    out += [f"  - {s.message}" for s in plan.shortfalls]
    return "\n".join(out)


def world_line(plan: Plan) -> str:
    """"world: 2 nodes x 1 rank = 2 ranks, global batch 16": how the job spreads, and what one step takes in."""
    batch = f", global batch {plan.global_batch}" if plan.global_batch else ""
    return (f"world: {plan.nodes} node{'s' if plan.nodes != 1 else ''} x {_ranks(plan.ranks_per_node)} = "
            f"{_ranks(plan.world_size)}{batch}")


def _sizes(spread: bool, rank: int, node: int) -> tuple[str, ...]:
    return (_cell(rank), format_bytes(node)) if spread else (format_bytes(node),)


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _cell(n: int) -> str:
    return format_bytes(n) if n else "-"
