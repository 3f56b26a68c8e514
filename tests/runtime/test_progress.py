"""The progress bar and the final report say what the user needs: step, loss, tokens/s, ETA; loss trend, bytes."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from memstrata.api.report import RuntimeReport, StratumCounters
from memstrata.runtime.train.progress import LossSummary, ProgressBar, RunReport, render_report


def test_loss_summary_compares_first_and_last_five() -> None:
    s = LossSummary.of([6.0, 5.0, 4.0, 3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert s.first_mean == pytest.approx(4.0) and s.last_mean == pytest.approx(1.0) and s.ratio == pytest.approx(0.25)
    with pytest.raises(ValueError):
        LossSummary.of([])


def test_plain_progress_lines_off_a_terminal() -> None:
    out = io.StringIO()
    with ProgressBar(4, console=Console(file=out, width=200)) as bar:
        bar.update(RuntimeReport(stage="training", step=1, total_steps=4, loss=2.5, tokens_per_second=1500.0,
                                 elapsed_seconds=3.0))
    assert out.getvalue().strip() == "step 1/4  loss 2.5000  1,500 tok/s  ETA 9s"


def test_report_prints_loss_trend_bytes_and_phases() -> None:
    losses = [5.0, 4.8, 4.6, 4.4, 4.2, 3.0, 2.9, 2.8, 2.7, 2.6]
    report = RunReport(
        job="t", model="gpt-tiny", parameters=527_872, precision="bf16", engine="deepspeed",
        offload={"param": "nvme", "optimizer": "nvme"}, steps=10, tokens=10_240, tokens_per_second=2000.0,
        losses=losses, loss=LossSummary.of(losses), peak_rss_bytes=800 << 20,
        strata={"dram": StratumCounters(peak_bytes=800 << 20),
                "nvme": StratumCounters(peak_bytes=6 << 20, bytes_written=600 << 20, bytes_read=610 << 20)},
        swap_dir="/scratch/x", swap_files=6, swap_files_after_init=2,
        phases={"init": 10.0, "forward": 11.0, "backward": 30.0, "step": 3.0, "total": 54.0},
        deepspeed_settings=[{"key": "zero_optimization.sub_group_size", "value": 262144, "default": 10**9,
                             "why": "at least 1 MiB of fp32"}],
    )
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "loss: first 5 steps mean 4.6000 -> last 5 mean 2.8000 (x0.61, falling)" in text
    assert "600.0 MiB" in text and "610.0 MiB" in text and "800.0 MiB" in text
    assert "backward" in text and "zero_optimization.sub_group_size" in text
