"""The progress bar and the final report say what the user needs: step, loss, tokens/s, ETA; loss trend, bytes."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from memstrata.api.report import RuntimeReport, StratumCounters
from memstrata.runtime.train.observe.progress import LossSummary, ProgressBar, RunReport, render_report


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


def test_progress_lines_show_the_learning_rate_when_known() -> None:
    out = io.StringIO()
    with ProgressBar(4, console=Console(file=out, width=200)) as bar:
        bar.update(RuntimeReport(stage="training", step=2, total_steps=4, loss=2.5, learning_rate=1.5e-3,
                                 tokens_per_second=1500.0, elapsed_seconds=4.0))
    assert out.getvalue().strip() == "step 2/4  loss 2.5000  lr 1.50e-03  1,500 tok/s  ETA 4s"


def test_progress_lines_carry_the_latest_validation_loss() -> None:
    out = io.StringIO()
    with ProgressBar(4, console=Console(file=out, width=200)) as bar:
        bar.update(RuntimeReport(stage="training", step=3, total_steps=4, loss=2.5, validation_loss=2.25,
                                 learning_rate=1.5e-3, tokens_per_second=1500.0, elapsed_seconds=3.0))
    assert out.getvalue().strip() == "step 3/4  loss 2.5000  val 2.2500  lr 1.50e-03  1,500 tok/s  ETA 1s"


def test_progress_lines_show_nvme_traffic_between_steps_while_it_moves() -> None:
    out = io.StringIO()

    def at(step: int, elapsed: float, read: int, written: int) -> RuntimeReport:
        return RuntimeReport(stage="training", step=step, total_steps=4, loss=2.5, tokens_per_second=1500.0,
                             elapsed_seconds=elapsed, strata={"nvme": StratumCounters(bytes_read=read,
                                                                                      bytes_written=written)})

    with ProgressBar(4, console=Console(file=out, width=200)) as bar:
        bar.update(at(1, 2.0, 10**9, 10**9))  # the first step: nothing to compare with
        bar.update(at(2, 4.0, 10**9 + 600 * 10**6, 10**9 + 200 * 10**6))  # 600 MB read, 200 MB written in 2 s
        bar.update(at(3, 5.0, 10**9 + 600 * 10**6, 10**9 + 200 * 10**6))  # nothing moved
    assert out.getvalue().splitlines() == ["step 1/4  loss 2.5000  1,500 tok/s  ETA 6s",
                                           "step 2/4  loss 2.5000  1,500 tok/s  nvme r 300 MB/s w 100 MB/s  ETA 4s",
                                           "step 3/4  loss 2.5000  1,500 tok/s  ETA 2s"]


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
    assert "first 5 steps 4.6000 -> last 5 2.8000 (x0.61, falling)" in text
    assert "600.0 MiB" in text and "610.0 MiB" in text and "800.0 MiB" in text
    assert "backward" in text
    # The DeepSpeed settings table is for --verbose: the default report stays compact.
    assert "zero_optimization.sub_group_size" not in text
    out = io.StringIO()
    render_report(report, Console(file=out, width=200), verbose=True)
    assert "zero_optimization.sub_group_size" in out.getvalue()


def test_report_fits_100_columns_and_shows_validation_output_and_sample() -> None:
    from memstrata.api.jobstatus import OutputStatus
    from memstrata.runtime.train.observe.progress import Sample

    losses = [2.0, 1.5, 1.0, 0.5, 0.3]
    report = RunReport(
        job="chat", model="/models/SmolLM2-135M-Instruct", parameters=134_515_008, precision="bf16",
        engine="memstrata", offload={"param": "nvme", "optimizer": "nvme"}, steps=5, tokens=2_560,
        tokens_per_second=50.0, losses=losses, loss=LossSummary.of(losses), peak_rss_bytes=3 << 30,
        learning_rates=[0.0, 1e-3, 2e-3, 1.1e-3, 2e-4], schedule="cosine to 0.1x, 2 warmup steps", layer_major=8,
        load_peak_rss_bytes=2 << 30, model_bytes=269 << 20, validation_losses={0: 2.72, 5: 0.19},
        output=OutputStatus(path="/output/chat", step=5, files=6, bytes=269 << 20),
        sample=Sample(prompt="What is the capital of Vosessa?", before="It is Paris.", after="Brengate."),
        strata={"dram": StratumCounters(peak_bytes=3 << 30)}, swap_dir="/scratch/x", swap_files=0,
        swap_files_after_init=0, phases={"init": 10.0, "total": 60.0},
        deepspeed_settings=[{"key": "k" * 60, "value": 1, "default": 2, "why": "w" * 200}],
    )
    out = io.StringIO()
    render_report(report, Console(file=out, width=100))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 100
    text = "\n".join(lines)
    assert "2.7200 at step 0 -> 0.1900 at step 5" in text
    assert "cosine to 0.1x, 2 warmup steps: 0.00e+00 first, 2.00e-03 peak, 2.00e-04 last" in text
    assert "2.0 GiB by the end of loading (269.0 MiB of weights)" in text
    assert "/output/chat (6 files, 269.0 MiB of weights, step 5)" in text
    assert "It is Paris." in text and "Brengate." in text
    assert "weights -> nvme, optimizer state -> nvme; 8 micro-batches layer-major" in text


def test_report_shows_the_swap_layer_and_keeps_its_json_names() -> None:
    from memstrata.runtime.swap.status import SwapStatus

    # The swap status as the harness and earlier reports wrote it: camelCase, gradients null when not in DRAM.
    wire = {
        "nvme": {"namespaces": ["/dev/nvme1n1"], "bytesWritten": 700 << 20, "bytesRead": 650 << 20,
                 "bytesLive": 40 << 20, "bytesLivePeak": 48 << 20, "extentsLive": 12,
                 "byKind": {"optimizer": {"written": 500 << 20, "read": 450 << 20},
                            "param": {"written": 200 << 20, "read": 200 << 20}},
                 "ioTokenWaitSeconds": 0.25, "ioTokenBypasses": 0},
        "dram": {"lockedBytes": 96 << 20, "lockedPeakInUse": 64 << 20, "trimmedBytes": 0, "pinnedBytes": 3 << 20,
                 "optimizerCacheBytes": 12 << 20, "residentStateBytes": 36 << 20, "residentSubgroups": 3,
                 "residentWeightBytes": 4 << 20, "prefetchHits": 5, "optimizerCacheHits": 7,
                 "slicedSubgroups": 1, "slicesUpdated": 12, "subGroupOrders": [[0, 1], [1, 0]],
                 "gradients": None, "vmLockedBytes": 96 << 20, "hugePageTensors": False},
        "activations": {"stratum": "cxl", "numaNodes": [2, 3], "livePeakBytes": 24 << 20,
                        "offloadedBytes": 120 << 20, "returnedBytes": 120 << 20, "prefetched": 19, "tensors": 20, "lockedBytes": 32 << 20},
        "updateOverlap": {"on": True, "mode": "beside the forward", "refused": "", "updates": 4, "updateSeconds": 2.0,
                          "forwardWaits": 9, "forwardWaitSeconds": 0.5, "joinWaitSeconds": 0.25, "backwardWaits": 0,
                          "backwardWaitSeconds": 0.0, "lateSubgroups": 0, "shadowPeakBytes": 0},
    }
    losses = [5.0, 4.0, 3.0, 2.0, 1.0]
    report = RunReport(
        job="t", model="gpt-tiny", parameters=527_872, precision="bf16", engine="memstrata",
        offload={"param": "nvme", "optimizer": "nvme"}, steps=5, tokens=5_120, tokens_per_second=2000.0,
        losses=losses, loss=LossSummary.of(losses), peak_rss_bytes=800 << 20,
        strata={"nvme": StratumCounters(peak_bytes=48 << 20, bytes_written=700 << 20, bytes_read=650 << 20)},
        swap_dir="/scratch/x", swap_files=0, swap_files_after_init=0, phases={"total": 1.0}, deepspeed_settings=[],
        memstrata=SwapStatus.model_validate(wire),
    )
    assert report.model_dump(mode="json")["memstrata"] == wire  # --report-json: the same names as before
    out = io.StringIO()
    render_report(report, Console(file=out, width=200), verbose=True)
    text = out.getvalue()
    assert "memstrata swap layer" in text and "written through 1 namespace(s)" in text
    assert "optimizer state written / read" in text and "500.0 MiB / 450.0 MiB" in text
    assert "12.0 MiB, 7 hits" in text
    assert "torch's CPU blocks on huge pages" in text and "NO (torch allocated first" in text
    assert "pinned for ZeRO-3 (weights, gradients; exact)" in text and "3.0 MiB" in text
    assert "activation checkpoints, peak held (NUMA 2,3)" in text and "24.0 MiB" in text
    assert "activation checkpoints moved, 19 prefetched" in text and "120.0 MiB" in text
    assert "update beside the forward: 4 updates, 2.00 s of them, 1.25 s hidden behind the forward" in text


def test_the_delayed_update_is_reported_as_such_with_the_backwards_waits_and_the_shadows() -> None:
    from memstrata.runtime.swap.status import OverlapStatus
    from memstrata.runtime.train.observe.progress import update_line

    ov = OverlapStatus(on=True, mode="delayed", updates=9, update_seconds=30.8, join_wait_seconds=0.2,
                       backward_waits=12, backward_wait_seconds=1.8, late_subgroups=235, shadow_peak_bytes=302 << 20)
    assert update_line(ov) == (
        "delayed update (spec.training.update): 9 updates, 30.80 s of them, 28.80 s hidden behind the next forward "
        "and backward (the backward waited 1.80 s for gradients the update had not read, 0.20 s at its end; 235 "
        "sub-groups' weights through shadows, at most 302.0 MiB held)")
    assert update_line(OverlapStatus(on=False, refused="delayed update refused: weights on NVMe")) == \
        "update in place: delayed update refused: weights on NVMe"


def test_a_short_runs_loss_summary_never_compares_a_window_with_itself() -> None:
    """Three steps: the first against the last, not the same three steps twice (which read 'x1.00, NOT falling
    enough' while the loss fell); one step has no trend to judge."""
    s = LossSummary.of([2.0, 1.9, 1.5])
    assert (s.first, s.last) == ([2.0], [1.5]) and s.ratio == pytest.approx(0.75)
    assert LossSummary.of([float(k) for k in range(20, 0, -1)]).first == [20.0, 19.0, 18.0, 17.0, 16.0]
    report = RunReport(job="t", model="gpt-tiny", parameters=1, precision="bf16", engine="deepspeed",
                       offload={"param": "cpu", "optimizer": "cpu"}, steps=1, tokens=64, tokens_per_second=1.0,
                       losses=[2.5], loss=LossSummary.of([2.5]), peak_rss_bytes=1, strata={}, swap_dir="",
                       swap_files=0, swap_files_after_init=0, phases={"total": 1.0}, deepspeed_settings=[])
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    assert "one step: no trend yet" in out.getvalue() and "NOT falling" not in out.getvalue()
