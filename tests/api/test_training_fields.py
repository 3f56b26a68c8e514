"""The new training and output fields refuse what cannot run, naming the field, in the CLI's validation (the
API server's CEL rules are checked in e2e/operator/test_admission.py)."""
from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from memstrata.api.finetunejob import FineTuneJobSpec

BASE: dict[str, Any] = {"model": {"preset": "gpt-tiny"}, "dataset": {"synthetic": "copy"},
                        "training": {"steps": 10, "sequenceLength": 64}}


@pytest.mark.parametrize(("change", "message"), [
    ({"training": {"steps": 10, "sequenceLength": 64, "schedule": {"type": "cosine", "warmupSteps": 11}}},
     "schedule.warmupSteps: 11 is more than training.steps (10)"),
    ({"training": {"steps": 10, "sequenceLength": 64, "schedule": {"warmupSteps": 2, "warmupRatio": 0.1}}},
     "schedule: set warmupSteps or warmupRatio, not both (warmupSteps 2, warmupRatio 0.1)"),
    ({"training": {"steps": 10, "sequenceLength": 64, "schedule": {"warmupRatio": 1.0}}}, "warmupRatio"),
    ({"output": {"path": "/out/m", "metricsPath": "/out/m/logs"}}, "output.metricsPath must not be output.path"),
    ({"training": {"steps": 10, "sequenceLength": 64, "optimizer": {"beta1": 1.0}}}, "beta1"),
    ({"checkpoint": {"path": "/c", "keep": 0}}, "keep"),
    ({"output": {"path": "/out/m"}, "checkpoint": {"path": "/out/m/ckpt"}}, "checkpoint.path must not be output"),
])
def test_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FineTuneJobSpec.model_validate({**BASE, **change})


def test_defaults_keep_the_old_behaviour_and_metrics_go_beside_the_model() -> None:
    spec = FineTuneJobSpec.model_validate({**BASE, "output": {"path": "/out/m/"}})
    assert spec.training.schedule.type == "constant" and spec.training.schedule.warmup_steps == 0
    assert spec.training.gradient_clipping == 1.0 and spec.training.optimizer.weight_decay == 0.0
    assert spec.output is not None and spec.output.metrics_dir() == "/out/m-metrics"
