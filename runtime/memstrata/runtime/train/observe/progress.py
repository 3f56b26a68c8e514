"""What the user sees of a local run: a live progress bar, then the final report.

Both are fed by the same `RuntimeReport` the runtime would patch into the
FineTuneJob's status in a cluster, so the local view and `kubectl get ftj`
agree. The bar goes to stderr (a live rich bar on a terminal, one plain line
per step otherwise, so logs and CI stay readable); the report goes to stdout.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_serializer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from memstrata.api.jobstatus import OutputStatus
from memstrata.api.report import RuntimeReport, StratumCounters, format_duration
from memstrata.api.units import format_bytes
from memstrata.runtime.swap.status import OverlapStatus, SwapStatus


class ProgressBar:
    def __init__(self, total_steps: int, console: Console | None = None, *, quiet: bool = False) -> None:
        """`quiet`: show nothing (every rank but global rank 0, which speaks for all of them)."""
        self.console = console or Console(file=sys.stderr)
        self.total = total_steps
        self.quiet = quiet
        self.live = self.console.is_terminal and not quiet
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._io: tuple[float, int, int] | None = None  # the last report's (elapsed, NVMe read, NVMe written)

    def _nvme_rates(self, report: RuntimeReport) -> str:
        """"nvme r 120 MB/s w 80 MB/s": what the NVMe stratum moved since the previous report, per second of it;
        "-" before there is a previous report or while nothing moves."""
        nvme = report.strata.get("nvme")
        now = (report.elapsed_seconds, nvme.bytes_read, nvme.bytes_written) if nvme is not None else None
        last, self._io = self._io, now
        if now is None or last is None or now[0] <= last[0] or (now[1] == last[1] and now[2] == last[2]):
            return "-"
        seconds = now[0] - last[0]
        return f"r {(now[1] - last[1]) / seconds / 1e6:,.0f} MB/s w {(now[2] - last[2]) / seconds / 1e6:,.0f} MB/s"

    def __enter__(self) -> "ProgressBar":
        if self.live:
            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("val {task.fields[val]}"),
                TextColumn("lr {task.fields[lr]}"),
                TextColumn("{task.fields[rate]} tok/s"), TextColumn("nvme {task.fields[io]}"),
                TextColumn("ETA {task.fields[eta]}"), TimeElapsedColumn(), console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, loss="-", val="-", lr="-", rate="-",
                                                 io="-", eta="-")
        return self

    def update(self, report: RuntimeReport) -> None:
        loss = f"{report.loss:.4f}" if report.loss is not None else "-"
        rate = f"{report.tokens_per_second:,.0f}" if report.tokens_per_second else "-"
        lr = f"{report.learning_rate:.2e}" if report.learning_rate is not None else "-"
        val = f"{report.validation_loss:.4f}" if report.validation_loss is not None else "-"
        eta = report.progress().eta or "-"
        io = self._nvme_rates(report)
        if self.quiet:
            return
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=report.step, loss=loss, val=val, lr=lr, rate=rate, io=io,
                                  eta=eta)
        else:  # the latest validation loss, once there is one; NVMe's traffic, while it moves
            shown = (f"  val {val}" if report.validation_loss is not None else "") + (
                f"  lr {lr}" if report.learning_rate is not None else "")
            moved = f"  nvme {io}" if io != "-" else ""
            self.console.print(f"step {report.step}/{report.total_steps}  loss {loss}{shown}  {rate} tok/s{moved}  "
                               f"ETA {eta}", highlight=False)

    def message(self, text: str) -> None:
        if not self.quiet:
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
        # Never overlapping windows: on a short run, the first and the last halves (one step each on three).
        window = max(1, min(window, len(losses) // 2))
        first, last = losses[:window], losses[-window:]
        fm, lm = sum(first) / len(first), sum(last) / len(last)
        return cls(first=first, last=last, first_mean=fm, last_mean=lm, ratio=lm / fm if fm else float("inf"))


class Sample(BaseModel):
    """The model's answer to one prompt before and after fine-tuning."""

    prompt: str
    before: str
    after: str | None = None


class RunReport(BaseModel):
    """The final report of `memstrata run` (also written as JSON by --report-json)."""

    job: str
    model: str
    parameters: int
    trainable_parameters: int | None = Field(None, description="Parameters that trained, when not all did "
                                                               "(training.method lora: the adapters').")
    precision: str
    engine: str
    offload: dict[str, str]
    steps: int
    tokens: int
    tokens_per_second: float
    losses: list[float]
    loss: LossSummary | None  # None: this attempt resumed at the last step and trained none
    resumed_from: int | None = None
    learning_rates: list[float] = Field([], description="The learning rate each step was taken with.")
    schedule: str = Field("", description="spec.training.schedule in words: 'cosine to 0.1x, 10 warmup steps'.")
    layer_major: int = Field(0, ge=0, description="Micro-batches a step that went through each layer together "
                                                  "(training.layerMajor); 0: one after the other.")
    peak_rss_bytes: int
    load_peak_rss_bytes: int = Field(0, description="Peak RSS of the process tree by the end of building and "
                                                     "loading the model (before the first step).")
    model_bytes: int = Field(0, description="Bytes of the model's weights in its directory (0 for a preset).")
    validation_losses: dict[int, float] = Field({}, description="Validation loss by step (0: before training).")
    output: OutputStatus | None = None
    kept_best: bool = Field(False, description="training.keepBest: the output is the model of the lowest "
                                               "validation loss.")
    epochs: dict[str, float] = Field({}, description="Passes over each dataset the run's steps made (records "
                                                     "drawn / records), from the first step on.")
    stopped_early: str | None = Field(None, description="Why the run ended before training.steps "
                                                        "(training.earlyStopping).")
    sample: Sample | None = None
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


WIDTH = 100


def render_report(r: RunReport, console: Console | None = None, *, verbose: bool = False) -> None:
    """The final report, compact (at most 100 columns); `verbose` adds the swap layer's counters and every
    DeepSpeed setting that differs from its defaults, with the reason."""
    console = console or Console(width=WIDTH)
    line = lambda label, text: console.print(f"{label:<11}{text}", highlight=False, soft_wrap=False)  # noqa: E731
    console.print(f"\n[bold]memstrata run: {r.job}[/bold]", highlight=False)
    lora = f", LoRA {r.trainable_parameters:,}" if r.trainable_parameters is not None else ""  # what trained
    line("model", f"{r.model} ({r.parameters:,} parameters{lora}, {r.precision})")
    waves = f"; {r.layer_major} micro-batches layer-major" if r.layer_major else ""
    line("engine", f"{r.engine}: weights -> {r.offload['param']}, optimizer state -> {r.offload['optimizer']}{waves}")
    if r.loss is None:
        line("loss", f"- (resumed at step {r.resumed_from}, the last: nothing left to train)")
    else:
        verdict = ("one step: no trend yet" if len(r.losses) < 2 else
                   "falling" if r.loss.ratio <= 0.8 else "NOT falling enough")
        since = f", this attempt, resumed at step {r.resumed_from}" if r.resumed_from else ""
        line("loss", f"first {len(r.loss.first)} steps {r.loss.first_mean:.4f} -> last {len(r.loss.last)} "
                     f"{r.loss.last_mean:.4f} (x{r.loss.ratio:.2f}, {verdict}{since})")
    if r.learning_rates:
        lrs, schedule = r.learning_rates, f"{r.schedule}: " if r.schedule else ""
        line("lr", f"{schedule}{lrs[0]:.2e} first, {max(lrs):.2e} peak, {lrs[-1]:.2e} last")
    if r.validation_losses:
        steps = sorted(r.validation_losses)
        first, last = r.validation_losses[steps[0]], r.validation_losses[steps[-1]]
        line("validation", f"{first:.4f} at step {steps[0]} -> {last:.4f} at step {steps[-1]}")
    line("speed", f"{r.steps} steps, {r.tokens:,} tokens, {r.tokens_per_second:,.0f} tok/s")
    if r.epochs:
        line("data", ", ".join(f"{e:.2f} epochs of {Path(name).name}" for name, e in r.epochs.items()))
    loading = f"; {format_bytes(r.load_peak_rss_bytes)} by the end of loading" if r.load_peak_rss_bytes else ""
    size = f" ({format_bytes(r.model_bytes)} of weights)" if r.model_bytes else ""
    line("host", f"peak RSS {format_bytes(r.peak_rss_bytes)}{loading}{size}")
    for name, c in r.strata.items():
        moved = f", written {format_bytes(c.bytes_written)}, read {format_bytes(c.bytes_read)}" \
            if c.bytes_written or c.bytes_read else ""
        line(name, f"peak {format_bytes(c.peak_bytes)}{moved}")
    line("time", ", ".join(f"{name} {format_duration(sec)}" for name, sec in r.phases.items()))
    if r.stopped_early is not None:
        line("stopped", r.stopped_early)
    if r.output is not None:
        best = ", the lowest validation loss" if r.kept_best else ""
        line("output", f"{r.output.path} ({r.output.files} files, {format_bytes(r.output.bytes)} of weights, "
                       f"step {r.output.step}{best})")
    if r.sample is not None:
        line("prompt", r.sample.prompt)
        line("  before", r.sample.before)
        if r.sample.after is not None:
            line("  after", r.sample.after)
    if not verbose:
        return
    if r.memstrata is not None:
        render_memstrata(r.memstrata, console)
    console.print(f"swap directory {r.swap_dir}: {r.swap_files} files at most ({r.swap_files_after_init} after init); "
                  "removed after the run", highlight=False)
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
    if dram.pinned_bytes:
        t.add_row("dram", "pinned for ZeRO-3 (weights, gradients; exact)", format_bytes(dram.pinned_bytes))
    t.add_row("dram", "optimizer sub-groups cached", f"{format_bytes(dram.optimizer_cache_bytes)}, "
              f"{dram.optimizer_cache_hits} hits")
    if dram.huge_page_tensors is not None:  # False costs the forward and backward a page fault per 4 KiB
        t.add_row("dram", "torch's CPU blocks on huge pages", "yes" if dram.huge_page_tensors else
                  "NO (torch allocated first; start with THP_MEM_ALLOC_ENABLE=1)")
    act = status.activations
    if act is not None:
        nodes = f" (NUMA {','.join(map(str, act.numa_nodes))})" if act.numa_nodes else ""
        t.add_row(act.stratum, f"activation checkpoints, peak held{nodes}", format_bytes(act.live_peak_bytes))
        t.add_row(act.stratum, f"activation checkpoints moved, {act.prefetched} prefetched",
                  format_bytes(act.offloaded_bytes))
    console.print(t)
    console.print(update_line(status.update_overlap))


def update_line(ov: OverlapStatus) -> str:
    """Where the updates ran and how much of them compute hid, in one line of the verbose report."""
    if not ov.on:
        return f"update in place: {ov.refused}"
    waited = ov.forward_wait_seconds + ov.backward_wait_seconds + ov.join_wait_seconds
    hidden = max(0.0, ov.update_seconds - waited)
    if ov.mode == "delayed":
        return (f"delayed update (spec.training.update): {ov.updates} updates, {ov.update_seconds:.2f} s of them, "
                f"{hidden:.2f} s hidden behind the next forward and backward (the backward waited "
                f"{ov.backward_wait_seconds:.2f} s for gradients the update had not read, {ov.join_wait_seconds:.2f} s "
                f"at its end; {ov.late_subgroups} sub-groups' weights through shadows, at most "
                f"{format_bytes(ov.shadow_peak_bytes)} held)")
    return (f"update beside the forward: {ov.updates} updates, {ov.update_seconds:.2f} s of them, {hidden:.2f} s "
            f"hidden behind the forward (it waited {ov.forward_wait_seconds:.2f} s for sub-groups, "
            f"{ov.join_wait_seconds:.2f} s at its end)")
