"""What the user sees of a local run: a live progress bar, then the final report.

Both are fed by the same `RuntimeReport` the runtime would patch into the
FineTuneJob's status in a cluster, so the local view and `kubectl get ftj`
agree. The bar goes to stderr (a live rich bar on a terminal, one plain line
per step otherwise, so logs and CI stay readable); the report goes to stdout.
"""
from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel, Field, field_serializer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from memstrata.api.report import RuntimeReport, StratumCounters, format_duration
from memstrata.api.units import format_bytes
from memstrata.runtime.swap.status import SwapStatus


class ProgressBar:
    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.console = console or Console(file=sys.stderr)
        self.total = total_steps
        self.live = self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> "ProgressBar":
        if self.live:
            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("ETA {task.fields[eta]}"), TimeElapsedColumn(), console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, loss="-", rate="-", eta="-")
        return self

    def update(self, report: RuntimeReport) -> None:
        loss = f"{report.loss:.4f}" if report.loss is not None else "-"
        rate = f"{report.tokens_per_second:,.0f}" if report.tokens_per_second else "-"
        eta = report.progress().eta or "-"
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=report.step, loss=loss, rate=rate, eta=eta)
        else:
            self.console.print(f"step {report.step}/{report.total_steps}  loss {loss}  {rate} tok/s  ETA {eta}",
                               highlight=False)

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()


class LossSummary(BaseModel):
    first: list[float]
    last: list[float]
    first_mean: float
    last_mean: float
    ratio: float

    @classmethod
    def of(cls, losses: list[float], window: int = 5) -> "LossSummary":
        if not losses:
            raise ValueError("no losses recorded")
        first, last = losses[:window], losses[-window:]
        fm, lm = sum(first) / len(first), sum(last) / len(last)
        return cls(first=first, last=last, first_mean=fm, last_mean=lm, ratio=lm / fm if fm else float("inf"))


class RunReport(BaseModel):
    """The final report of `memstrata run` (also written as JSON by --report-json)."""

    job: str
    model: str
    parameters: int
    precision: str
    engine: str
    offload: dict[str, str]
    steps: int
    tokens: int
    tokens_per_second: float
    losses: list[float]
    loss: LossSummary
    peak_rss_bytes: int
    strata: dict[str, StratumCounters]
    swap_dir: str
    swap_files: int
    swap_files_after_init: int
    phases: dict[str, float]
    deepspeed_settings: list[dict[str, Any]]
    memstrata: SwapStatus | None = Field(
        None, description="memory.engine memstrata: its swap layer's own per-stratum counters (SwapLayer.status()), "
                          "in the report's JSON in their camelCase wire form.")

    @field_serializer("memstrata")
    def _memstrata_wire(self, status: SwapStatus | None) -> dict[str, Any] | None:
        # The same JSON as every other reader of the swap status gets, whatever the report is dumped with.
        return status.wire() if status is not None else None


def render_report(r: RunReport, console: Console | None = None) -> None:
    console = console or Console()
    verdict = "falling" if r.loss.ratio <= 0.8 else "NOT falling enough"
    console.print(f"\n[bold]memstrata run: {r.job}[/bold]  {r.model} ({r.parameters:,} parameters, {r.precision}), "
                  f"engine {r.engine}, weights -> {r.offload['param']}, optimizer state -> {r.offload['optimizer']}")
    console.print(f"loss: first {len(r.loss.first)} steps mean {r.loss.first_mean:.4f} -> last {len(r.loss.last)} "
                  f"mean {r.loss.last_mean:.4f} (x{r.loss.ratio:.2f}, {verdict})", highlight=False)
    console.print(f"{r.steps} steps, {r.tokens:,} tokens, {r.tokens_per_second:,.0f} tok/s; "
                  f"peak RSS of the process tree {format_bytes(r.peak_rss_bytes)}", highlight=False)

    strata = Table(title="strata", title_justify="left")
    for col in ("stratum", "peak", "written", "read"):
        strata.add_column(col, justify="left" if col == "stratum" else "right")
    for name, c in r.strata.items():
        strata.add_row(name, format_bytes(c.peak_bytes), format_bytes(c.bytes_written), format_bytes(c.bytes_read))
    console.print(strata)
    if r.memstrata is not None:
        render_memstrata(r.memstrata, console)
    console.print(f"swap directory {r.swap_dir}: {r.swap_files} files at most ({r.swap_files_after_init} after init); "
                  "removed after the run", highlight=False)

    phases = Table(title="time per phase", title_justify="left")
    phases.add_column("phase")
    phases.add_column("seconds", justify="right")
    phases.add_column("", justify="right")
    for name, seconds in r.phases.items():
        phases.add_row(name, f"{seconds:.1f}", format_duration(seconds))
    console.print(phases)

    settings = Table(title="DeepSpeed settings that differ from its defaults", title_justify="left")
    for col in ("setting", "value", "default", "why"):
        settings.add_column(col, overflow="fold")
    for s in r.deepspeed_settings:
        settings.add_row(s["key"], str(s["value"]), str(s["default"]), s["why"])
    console.print(settings)


def render_memstrata(status: SwapStatus, console: Console) -> None:
    """memstrata's swap layer in its own words: what went through its NVMe engine and what it locked."""
    nvme, dram = status.nvme, status.dram
    t = Table(title="memstrata swap layer", title_justify="left")
    for col in ("stratum", "what", "bytes"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    t.add_row("nvme", f"written through {len(nvme.namespaces)} namespace(s)", format_bytes(nvme.bytes_written))
    t.add_row("nvme", "read", format_bytes(nvme.bytes_read))
    for kind, moved in sorted(nvme.by_kind.items()):
        t.add_row("nvme", f"{kind} state written / read", f"{format_bytes(moved.written)} / {format_bytes(moved.read)}")
    t.add_row("nvme", "peak held on the stratum", format_bytes(nvme.bytes_live_peak))
    t.add_row("dram", "locked (mlock'ed pool)", format_bytes(dram.locked_bytes))
    t.add_row("dram", "optimizer sub-groups cached", f"{format_bytes(dram.optimizer_cache_bytes)}, "
              f"{dram.optimizer_cache_hits} hits")
    console.print(t)
