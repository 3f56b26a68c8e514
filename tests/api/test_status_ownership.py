"""Which status fields a job's runtime may write: the report's patch stays inside
RUNTIME_STATUS_FIELDS, and the chart's admission policy guards every other field of the status."""
from __future__ import annotations

import re
from pathlib import Path

from memstrata.api.jobstatus import FineTuneJobStatus
from memstrata.api.report import RUNTIME_STATUS_FIELDS, RuntimeReport, StratumCounters

POLICY = Path(__file__).resolve().parents[2] / "charts/memstrata/templates/runtime-status-policy.yaml"


def test_the_runtimes_patch_writes_only_its_fields() -> None:
    report = RuntimeReport(stage="failed", step=3, total_steps=10, loss=2.5, message="out of memory",
                           strata={"dram": StratumCounters(peak_bytes=1 << 30)})
    assert set(report.status_patch()["status"]) <= set(RUNTIME_STATUS_FIELDS)
    FineTuneJobStatus.model_validate(report.status_patch()["status"])  # declared, typed: none of it is pruned


def test_the_policy_lets_the_runtime_write_exactly_its_fields() -> None:
    """An allow-list: the runtime's fields pass, every other one of the schema (the operator's, activePod and
    failedPods among them) is guarded, and so is any field added later."""
    (listed,) = re.findall(r'\$runtime := list ((?:"\w+" ?)+)', POLICY.read_text())
    allowed = re.findall(r'"(\w+)"', listed)
    assert allowed == list(RUNTIME_STATUS_FIELDS)
    assert {"checkpoint", "result"} <= set(allowed)
    fields = {f.alias or name for name, f in FineTuneJobStatus.model_fields.items()}
    assert set(allowed) <= fields  # every one the runtime may write is in the status schema


def test_the_runtime_reports_the_saved_model_as_status_output() -> None:
    from memstrata.api.jobstatus import OutputStatus

    saved = OutputStatus(path="/output/m", step=2000, files=4, bytes=16 << 30, validation_loss=1.25)
    report = RuntimeReport(stage="finished", step=2000, total_steps=2000, output=saved)
    patch = report.status_patch()["status"]
    assert patch["output"] == {"path": "/output/m", "step": 2000, "files": 4, "bytes": 16 << 30, "validationLoss": 1.25}
    assert "output" in RUNTIME_STATUS_FIELDS and "modelArchitecture" not in RUNTIME_STATUS_FIELDS
    assert "output" not in RuntimeReport(stage="training", step=1, total_steps=2).status_patch()["status"]


def test_the_progress_points_to_the_metrics_only_as_a_plain_path() -> None:
    """status.progress.metricsPath is written by the job's pod, whose token the job's own code holds: a path, never
    free text. One the pattern refuses is left out rather than failing the whole status patch."""
    plain = RuntimeReport(stage="training", step=1, total_steps=2, metrics_path="/output/run-1-metrics")
    assert plain.status_patch()["status"]["progress"]["metricsPath"] == "/output/run-1-metrics"
    for odd in ("/output/my run-metrics", "relative/metrics", "/x/<b>bold</b>", "/" + "a" * 4096):
        progress = RuntimeReport(stage="training", step=1, total_steps=2, metrics_path=odd).status_patch()["status"]
        assert progress["progress"].get("metricsPath") is None, odd
