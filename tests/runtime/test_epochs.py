"""training.epochs: a real `memstrata run` that counts its steps from the data and says how many passes it made;
and the refusals."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memstrata.api.finetunejob import FineTuneJobSpec


def _job(work: Path, records: int, **training: Any) -> Path:
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i}+{i}={2 * i}"}) + "\n" for i in range(records)))
    job = {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "epochs"},
           "spec": {"model": {"preset": "gpt-tiny"}, "dataset": {"path": str(data), "packing": False},
                    "training": {"sequenceLength": 32, "microBatch": 4, "learningRate": 1e-3, "precision": "fp32",
                                 **training},
                    "resources": {"gpus": 0}, "memory": {"engine": "deepspeed"},
                    "output": {"path": str(work / "model")}}}
    (work / "job.yaml").write_text(json.dumps(job))
    (work / "nvme").mkdir()
    return work / "job.yaml"


@pytest.mark.slow
def test_epochs_become_steps_and_the_report_says_how_many_passes_ran(cli: Any, tmp_path: Path) -> None:
    """30 records, one a sequence (unpacked), 4 a step: 2.5 epochs are 75 sequences, 19 steps (rounded up), which
    draw 76 records: 2.53 passes."""
    job = _job(tmp_path, 30, epochs=2.5)
    proc = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"), "--report-json", str(tmp_path / "r.json"),
               timeout=600, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "2.5 epochs of 30 sequences = 19 steps of 4 sequences" in said, said
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps"] == 19 and report["epochs"] == {str(tmp_path / "data.jsonl"): pytest.approx(76 / 30)}
    assert "2.53 epochs of data.jsonl" in said
    assert json.loads((tmp_path / "model" / "memstrata-run.json").read_text())["step"] == 19


def test_steps_and_epochs_are_one_or_the_other() -> None:
    base = {"model": {"preset": "gpt-tiny"}, "dataset": {"path": "/d.jsonl"}}
    for training, problem in [({}, "set exactly one of training.steps or training.epochs"),
                              ({"steps": 5, "epochs": 1}, "set exactly one of training.steps or training.epochs "
                                                          "(steps 5, epochs 1)"),
                              ({"epochs": 0}, "greater than 0")]:
        with pytest.raises(ValidationError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            FineTuneJobSpec.model_validate({**base, "training": training})
    with pytest.raises(ValidationError, match="a synthetic dataset is endless and has no epochs"):
        FineTuneJobSpec.model_validate({**base, "dataset": {"synthetic": "copy"}, "training": {"epochs": 1}})
