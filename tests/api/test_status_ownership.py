"""Which status fields a job's runtime may write: the report's patch stays inside
RUNTIME_STATUS_FIELDS, and the chart's admission policy guards every other field of the status."""
from __future__ import annotations

import re
from pathlib import Path

from memstrata.api.finetunejob import FineTuneJobStatus
from memstrata.api.report import RUNTIME_STATUS_FIELDS, RuntimeReport, StratumCounters

POLICY = Path(__file__).resolve().parents[2] / "charts/memstrata/templates/runtime-status-policy.yaml"


def test_the_runtimes_patch_writes_only_its_fields() -> None:
    report = RuntimeReport(stage="failed", step=3, total_steps=10, loss=2.5, message="out of memory",
                           strata={"dram": StratumCounters(peak_bytes=1 << 30)})
    assert set(report.status_patch()["status"]) <= set(RUNTIME_STATUS_FIELDS)


def test_the_policy_guards_every_other_status_field() -> None:
    fields = {f.alias or name for name, f in FineTuneJobStatus.model_fields.items()}
    (listed,) = re.findall(r'range \$field := list ((?:"\w+" ?)+)', POLICY.read_text())
    guarded = set(re.findall(r'"(\w+)"', listed))
    assert guarded == fields - set(RUNTIME_STATUS_FIELDS), (guarded, fields)


def test_the_runtime_reports_the_saved_model_as_status_output() -> None:
    from memstrata.api.finetunejob import OutputStatus

    saved = OutputStatus(path="/output/m", step=2000, files=4, bytes=16 << 30, validation_loss=1.25)
    report = RuntimeReport(stage="finished", step=2000, total_steps=2000, output=saved)
    patch = report.status_patch()["status"]
    assert patch["output"] == {"path": "/output/m", "step": 2000, "files": 4, "bytes": 16 << 30, "validationLoss": 1.25}
    assert "output" in RUNTIME_STATUS_FIELDS and "modelArchitecture" not in RUNTIME_STATUS_FIELDS
    assert "output" not in RuntimeReport(stage="training", step=1, total_steps=2).status_patch()["status"]
